"""`scripts/bench_step.py --peers`: the peer frameworks' harnesses (../shared/peers/README.md) on the same tiny
setting as the `peers` setting's arms, each in its own process under its own venv (DIR/tunix/bin/python,
DIR/trl/bin/python); a harness prints its median, min and max step and peak RSS, which become its row of the table.
"""

from __future__ import annotations

import os
import re
import subprocess

from bench_arm import ROOT

PEERS_SRC = os.path.join(os.path.dirname(ROOT), "shared", "peers")
PEERS = {"tunix": "tunix_grpo_bench.py", "trl": "trl_grpo_bench.py"}


def venvs(peers_dir: str) -> dict:
    """{peer: the python of its venv under `peers_dir`}; ValueError naming the first one (or harness) missing."""
    out = {}
    for name in PEERS:
        py = os.path.join(peers_dir, name, "bin", "python")
        if not os.path.isfile(py) or not os.path.isfile(os.path.join(PEERS_SRC, PEERS[name])):
            raise ValueError(f"no {py} (or harness in {PEERS_SRC}); see ../shared/peers/README.md")
        out[name] = py
    return out


def run_peer(name, python, env) -> dict:
    p = subprocess.run([python, os.path.join(PEERS_SRC, PEERS[name])], capture_output=True, text=True, env=env)
    m = re.search(r"peer=\S+ median_step_s=([\d.]+) min=([\d.]+) max=([\d.]+) peak_rss_mb=([\d.]+)", p.stdout)
    if p.returncode or m is None:
        raise RuntimeError(f"peer {name} failed (exit {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    first = re.search(r"^step\s+1 wall_s=([\d.]+)", p.stdout, re.M)
    setup = re.search(r"^setup_s=([\d.]+)", p.stdout, re.M)
    return {
        "arm": f"peer:{name}",
        "median_step_s": float(m.group(1)),
        "mean_step_s": float("nan"),  # the harnesses print medians only
        "min_step_s": float(m.group(2)),
        "max_step_s": float(m.group(3)),
        "first_step_s": float(first.group(1)) if first else float("nan"),
        "setup_s": float(setup.group(1)) if setup else float("nan"),
        "peak_rss_mb": float(m.group(4)),
        "phases": {},
    }

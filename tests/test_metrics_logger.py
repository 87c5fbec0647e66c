"""MetricsLogger: jsonl records, TensorBoard events, resume truncation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.metrics.logger import MetricsLogger


def _read(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_lines_parse_and_values_convert(tmp_path):
    with MetricsLogger(tmp_path, total_steps=3, show_progress=False) as lg:
        lg.log(
            1,
            {
                "reward/mean": jnp.float32(0.25),
                "length/max": np.int32(7),
                "grad/skipped": False,
                "codec/basis_cond": float("inf"),
                "grad/norm": jnp.array(float("nan")),
                "kl/ref": -jnp.inf,
                "per_boundary": jnp.arange(3),
                "note": "ok",
            },
        )
        lg.log(2, {"reward/mean": 0.5, "eval/accuracy": 0.75})
        # flushed per line: readable before close
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    recs = _read(tmp_path)
    assert recs[0] == {
        "step": 1,
        "reward/mean": 0.25,
        "length/max": 7,
        "grad/skipped": False,
        "codec/basis_cond": "inf",
        "grad/norm": "nan",
        "kl/ref": "-inf",
        "per_boundary": [0, 1, 2],
        "note": "ok",
    }
    assert recs[1] == {"step": 2, "reward/mean": 0.5, "eval/accuracy": 0.75}
    # strict JSON: no bare NaN/Infinity tokens
    json.loads(
        "[" + ",".join((tmp_path / "metrics.jsonl").read_text().splitlines()) + "]",
        parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"),
    )
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def _scalars(run):
    """(step, tag, value) of every scalar in the run's TensorBoard event file."""
    import struct

    from tensorboardX.proto import event_pb2

    raw = next(run.glob("events.out.tfevents.*")).read_bytes()
    vals, i = [], 0
    while i < len(raw):  # TFRecord framing: len u64, crc u32, data, crc u32
        (n,) = struct.unpack("<Q", raw[i : i + 8])
        ev = event_pb2.Event.FromString(raw[i + 12 : i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            vals.append((ev.step, v.tag, round(v.simple_value, 6)))
    return vals


def test_tensorboard_scalars_readable(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, show_progress=False) as lg:
        lg.log(1, {"reward/mean": 0.1, "kl/ref": "inf", "note": "text", "per_boundary": [1, 2]})
        lg.log(2, {"reward/mean": 0.3})
    vals = _scalars(tmp_path)
    # every scalar of a step in one event; text and lists are not TensorBoard scalars
    assert sorted(vals) == [(1, "kl/ref", float("inf")), (1, "reward/mean", 0.1), (2, "reward/mean", 0.3)]


def test_resume_truncates_later_steps(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5, show_progress=False) as lg:
        for s in range(1, 5):
            lg.log(s, {"reward/mean": s / 10, **({"eval/accuracy": s / 4} if s == 2 else {})})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # torn line from a crash
    with MetricsLogger(tmp_path, total_steps=5, show_progress=False, resume_from_step=2) as lg:
        assert lg._last == {"reward": 0.2, "eval": 0.5}  # the bar shows the state at the resume point
        lg.log(3, {"reward/mean": 0.9})
    assert [(r["step"], r["reward/mean"]) for r in _read(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.9)]


def test_progress_bar_runs(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=2, show_progress=True) as lg:
        lg.log(1, {"reward/mean": 0.5, "eval/accuracy": 0.25})
        lg.log(2, {"reward/mean": 0.6})
        assert lg._bar.n == 2
    err = capsys.readouterr().err
    assert "reward=0.600" in err and "eval=0.250" in err


def test_unloggable_value_raises(tmp_path):
    with MetricsLogger(tmp_path, total_steps=1, show_progress=False) as lg:
        with pytest.raises(TypeError, match="not loggable"):
            lg.log(1, {"x": object()})


def test_a_fresh_process_logs_without_importing_torch(tmp_path):
    """tensorboardX imports torch at module level (~1.5 s of CPU per trainer start); the logger keeps it out, the
    events still carry the scalars, and torch imports normally afterwards in the same process."""
    import subprocess
    import sys

    code = f"""
import sys
from twocircuit_jax.metrics.logger import MetricsLogger
with MetricsLogger({str(tmp_path)!r}, total_steps=1, show_progress=False) as lg:
    lg.log(1, {{"reward/mean": 0.5}})
assert "torch" not in sys.modules, "torch was imported"
import torch
print("torch", torch.__version__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("torch "), out.stderr[-2000:]
    assert _scalars(tmp_path) == [(1, "reward/mean", 0.5)]

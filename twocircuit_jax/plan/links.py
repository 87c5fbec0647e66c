"""The plan per link: a step's collective bytes over the fast links (inside an island) and over the slow link
(between islands, parallel/mesh.py), and the step's roofline bound at several slow-link bandwidths, beside the dense
twin's (the same config with both circuits' compression off) when `twocircuit plan --dense-twin` compiles it.

Per program p with r_p calls per step, o_p its bound with the slow link infinitely fast (compute, HBM, fast links:
plan/roofline.py) and s_p its slow-link bytes per call, the step at slow-link bandwidth B (bytes/s per device) is
    step(B) = sum_p r_p max(o_p, s_p / B)      (a generation call: r_p (o_p + s_p / B), its terms are summed)
The slow link bounds the step below B* = S / step(inf), S = sum_p r_p s_p the step's slow-link bytes: there moving
them alone takes longer than everything else of the step's bound. The speedup is dense step(B) / step(B).
"""

from __future__ import annotations

import dataclasses

from twocircuit_jax.plan.roofline import gbps_bytes

DEFAULT_GBPS = (100.0, 25.0, 1.0)


def dense_twin(cfg):
    """The same run with both circuits' compression off: no codec, no gradient codec, no anchor."""
    from twocircuit_jax.config.sections import NoActivationCodec, NoGradCodec

    return dataclasses.replace(
        cfg,
        fast=dataclasses.replace(cfg.fast, codec=NoActivationCodec(), grad_codec=NoGradCodec()),
        anchor=dataclasses.replace(cfg.anchor, enabled=False),
    )


def parse_gbps(text: str) -> tuple:
    """`--dcn-gbps 100,25,1` -> (100.0, 25.0, 1.0); ConfigError on anything but positive numbers."""
    from twocircuit_jax.config.base import ConfigError

    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(x <= 0 for x in out):
        raise ConfigError("--dcn-gbps", f"got {text!r}; want positive Gbit/s, comma-separated (e.g. 100,25,1)")
    return out


def step_at(plan: dict, bytes_per_s: float) -> float | None:
    """The step's bound at slow-link bandwidth `bytes_per_s` (module doc); None without a roofline."""
    total = 0.0
    for r in plan["programs"].values():
        lk = r.get("links")
        if lk is None:
            return None
        slow_s = lk["slow_bytes"] / bytes_per_s
        total += r["runs_per_step"] * (lk["other_s"] + slow_s if lk["sum"] else max(lk["other_s"], slow_s))
    return total


def summary(plan: dict, gbps: tuple, dense: dict | None = None) -> dict:
    """Bytes per step on each link and the step at each of `gbps`, with the dense twin's beside when given."""
    s = plan["step"]
    out = {"islands": plan["islands"], "fast_bytes": s["fast_bytes"], "slow_bytes": s["slow_bytes"], "rows": []}
    inf = step_at(plan, float("inf"))
    out["step_s_fast_only"] = inf
    out["slow_bound_below_gbps"] = (s["slow_bytes"] / inf) * 8 / 1e9 if inf else None
    if dense is not None:
        out["dense_slow_bytes"] = dense["step"]["slow_bytes"]
        out["dense_fast_bytes"] = dense["step"]["fast_bytes"]
        d_inf = step_at(dense, float("inf"))
        out["dense_slow_bound_below_gbps"] = (dense["step"]["slow_bytes"] / d_inf) * 8 / 1e9 if d_inf else None
    for g in gbps:
        row = {"gbps": g, "slow_s": s["slow_bytes"] / gbps_bytes(g), "step_s": step_at(plan, gbps_bytes(g))}
        if dense is not None:
            row["dense_slow_s"] = dense["step"]["slow_bytes"] / gbps_bytes(g)
            row["dense_step_s"] = step_at(dense, gbps_bytes(g))
            if row["step_s"] and row["dense_step_s"] is not None:
                row["speedup"] = row["dense_step_s"] / row["step_s"]
        out["rows"].append(row)
    return out


def render(links: dict) -> str:
    from twocircuit_jax.plan.table import seconds, size

    def gb(x):
        return "-" if x is None else f"{x:.3g} Gb/s"

    def sec(x):
        return "-" if x is None else seconds(x)

    dense = "dense_slow_bytes" in links
    out = [
        f"links per step, per device: fast {size(links['fast_bytes'])}, slow {size(links['slow_bytes'])} "
        f"({links['islands']} islands)"
        + (
            f"; dense twin: fast {size(links['dense_fast_bytes'])}, slow {size(links['dense_slow_bytes'])}"
            if dense
            else ""
        )
    ]
    out.append(
        f"  step bound with an infinitely fast slow link {sec(links['step_s_fast_only'])}; bound by the slow link "
        f"below {gb(links['slow_bound_below_gbps'])}"
        + (f" (dense twin below {gb(links['dense_slow_bound_below_gbps'])})" if dense else "")
    )
    head = ["DCN Gb/s", "slow link", "step bound"] + (["dense slow link", "dense step", "speedup"] if dense else [])
    table = [head]
    for r in links["rows"]:
        row = [f"{r['gbps']:g}", sec(r["slow_s"]), sec(r["step_s"])]
        if dense:
            sp = r.get("speedup")
            row += [sec(r["dense_slow_s"]), sec(r["dense_step_s"]), "-" if sp is None else f"{sp:.2f}x"]
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(out)

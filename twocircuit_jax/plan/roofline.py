"""Roofline lower bounds and model-flop utilisation: plain arithmetic on measured numbers, no compiler here.

A program's time per call is at least the longest of its three resource times on one chip:
    max(flops / peak bf16 FLOP/s, bytes accessed / HBM bandwidth, collective bytes / ICI bandwidth)
(flops and bytes accessed per device from XLA's cost analysis, which counts a loop's body once: the compute term
takes the model's flops per device where they are larger, and the HBM term stays a lower bound; collective bytes
per data replica from the HLO). A
step is at least the sum over its programs of calls x that bound. Model flops count the parameters' matmuls only,
6 N per token where a gradient is taken (train step, anchor fire) and 2 N per token of a forward-only pass (the
log-prob passes), N = every parameter (the tied embedding once, as the LM head's matmul); attention's
sequence-squared term is not counted. The implied MFU = model flops / (devices x peak x step bound) is therefore an
upper bound on what the step can reach.
"""

from __future__ import annotations


def program_bound(flops: float, hbm_bytes: float, coll_bytes: float, chip) -> dict:
    """Seconds per call of each resource and the bound (their max) on `chip` (plan/chips.py Chip)."""
    t = {
        "compute_s": flops / chip.peak_bf16_flops,
        "hbm_s": hbm_bytes / chip.hbm_bytes_per_s,
        "collective_s": coll_bytes / chip.ici_bytes_per_s,
    }
    t["bound_s"] = max(t.values())
    t["limit"] = max(("compute_s", "hbm_s", "collective_s"), key=lambda k: t[k])[: -len("_s")]
    return t


def model_flops(n_params: int, tokens: int, backward: bool) -> float:
    return (6.0 if backward else 2.0) * n_params * tokens


def mfu(flops_per_step: float, devices: int, chip, step_s: float) -> float:
    return flops_per_step / (devices * chip.peak_bf16_flops * step_s) if step_s > 0 else 0.0

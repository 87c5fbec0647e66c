"""Roofline lower bounds and model-flop utilisation: plain arithmetic on measured numbers, no compiler here.

A program's time per call is at least the longest of its resource times on one chip:
    max(flops / peak bf16 FLOP/s, bytes accessed / HBM bandwidth, fast-link bytes / ICI bandwidth,
        slow-link bytes / DCN bandwidth)
The fast and slow links are the collectives' two networks (parallel/mesh.py islands; fast/hlo_bytes.py puts a
collective on the slow link when its groups span islands): a max, not a sum, since each is a separate resource that
can overlap the others at best, so the bound stays a lower bound. Without a DCN bandwidth every collective byte is
counted at the ICI bandwidth (one network). The DCN bandwidth is per device (a host's NIC shared by its chips:
divide by the chips per host); `twocircuit plan --dcn-gbps` takes it in Gbit/s.
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


def program_bound(flops: float, hbm_bytes: float, coll_bytes: float, chip, slow_bytes=0.0, dcn_bytes_per_s=None):
    """Seconds per call of each resource and the bound (their max) on `chip` (plan/chips.py Chip). With
    `dcn_bytes_per_s`, the `slow_bytes` of `coll_bytes` go over the slow link ("dcn_s"), the rest over ICI."""
    fast = coll_bytes - slow_bytes if dcn_bytes_per_s else coll_bytes
    t = {
        "compute_s": flops / chip.peak_bf16_flops,
        "hbm_s": hbm_bytes / chip.hbm_bytes_per_s,
        "collective_s": fast / chip.ici_bytes_per_s,
    }
    if dcn_bytes_per_s:
        t["dcn_s"] = slow_bytes / dcn_bytes_per_s
    keys = list(t)
    t["bound_s"] = max(t.values())
    t["limit"] = max(keys, key=lambda k: t[k])[: -len("_s")]
    return t


def gbps_bytes(gbps: float) -> float:
    """Gbit/s -> bytes/s."""
    return gbps * 1e9 / 8


def model_flops(n_params: int, tokens: int, backward: bool) -> float:
    return (6.0 if backward else 2.0) * n_params * tokens


def mfu(flops_per_step: float, devices: int, chip, step_s: float) -> float:
    return flops_per_step / (devices * chip.peak_bf16_flops * step_s) if step_s > 0 else 0.0


def generation_bound(
    g, model, n_params: int, shards: int, tensor: int, coll_bytes: float, chip, slow_bytes=0.0, dcn_bytes_per_s=None
) -> dict:
    """Seconds per call of one generate call (plan/programs.py Generation `g`) on `chip`, from shapes: XLA's cost
    analysis counts the decode loop's body once, so the loop is counted here. Each device holds rows/shards rows;
    the weights are whole on it in the compute dtype (split over `tensor` only).
        prefill  max(2 N x (its prompts x P) / tensor / peak, weights / HBM bandwidth)
        decode   max_new x max(2 N x rows / tensor / peak, (weights + rows x (P + max_new) x KV bytes a token)
                 / HBM bandwidth): every step reads the weights and the whole cache (masked); a call that stops
                 early runs fewer steps, so this is the bound at the cap
        links    the call's collective bytes (the weights' gather, the loop's all-done flag counted once) / ICI,
                 and with `dcn_bytes_per_s` its slow-link bytes / that instead of ICI
    and the bound is their sum (prefill, then decode)."""
    from twocircuit_jax.model.qwen2 import dtype_of

    it = jnp_itemsize(dtype_of(model.compute_dtype))
    weights = n_params * it / tensor
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * it
    rows = g.usage.rows / shards
    prompts = max(g.prompts / shards, 1.0)  # a call of fewer prompts than shards prefills them on every device
    pre_c = 2.0 * n_params * prompts * g.prompt_len / tensor / chip.peak_bf16_flops
    pre_h = weights / chip.hbm_bytes_per_s
    step_c = 2.0 * n_params * rows / tensor / chip.peak_bf16_flops
    step_h = (weights + rows * (g.prompt_len + g.max_new) * kv_token) / chip.hbm_bytes_per_s
    t = {
        "compute_s": pre_c + g.max_new * step_c,
        "hbm_s": pre_h + g.max_new * step_h,
        "collective_s": (coll_bytes - (slow_bytes if dcn_bytes_per_s else 0.0)) / chip.ici_bytes_per_s,
    }
    links = t["collective_s"]
    if dcn_bytes_per_s:
        t["dcn_s"] = slow_bytes / dcn_bytes_per_s
        links += t["dcn_s"]
    t["bound_s"] = max(pre_c, pre_h) + g.max_new * max(step_c, step_h) + links
    t["limit"] = "hbm" if step_h >= step_c else "compute"
    t["decode_step_s"] = max(step_c, step_h)
    return t


def jnp_itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize

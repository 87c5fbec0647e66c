"""The vLLM side of `twocircuit plan` (`--sampler-chip NAME`): how much of a step's generation one engine on a
named GPU holds, how long it takes, and how many engines keep it within the training programs' bound.

All of it is arithmetic on the run config's shapes and the GPU's datasheet numbers (plan/chips.py GPUS): estimates
to size a rental by, which timings measured on a lent GPU replace. One engine is one GPU (the server runs no tensor
parallelism). Symbols: N parameters (from the shapes, as model/qwen2.py init_params builds them), b the engine's
bytes per value (sampler.dtype; `auto` = model.param_dtype, as train/setup.py starts the server: a float32 run
serves float32 weights and KV), L layers, Hkv KV heads, D head_dim, P = train.max_prompt_len,
M = sampler.sampling.max_new_tokens, rows = train.prompts_per_step x sampler.n per step.

    weights           W = N b                      (every tensor vLLM loads; the tied embedding once)
    KV per token      2 L Hkv D b                  (keys and values of every layer)
    KV per row        KV per token x (P + M)       (vLLM reserves blocks for the whole row as it grows)
    reserve           1 GiB (CUDA context, cuBLAS workspaces, allocator slack: a round allowance)
                      + the profiling forward's activations, T (3 F + (Hq + 2 Hkv) D + 2 H) b for T batched tokens
                      + 2 S V 4 bytes of float32 logits and log-probs for S rows (vLLM's sampler warm-up)
    KV cache          gpu_memory_utilization x memory - W - reserve
    rows at once      R = min(floor(KV cache / KV per row), S)      (0: the engine does not fit)
S and T are vLLM's defaults for max_num_seqs and max_num_batched_tokens, which the server leaves alone
(VLLM_DEFAULTS). The server runs enforce_eager, so no CUDA-graph memory is reserved.

Time, for r rows decoded together (a wave), bf16 or fp32 peak by the engine's dtype:
    decode step       max((W + r x KV per token x (P + M/2)) / bandwidth, 2 N r / peak)
                      (every weight read once per step; each row's KV at its average length over the wave)
    prefill           2 N r P / peak     (a flops bound: prompts are taken at their full P tokens)
    wave              prefill + M x decode step
    one engine        the step's rows in waves of R: every row is taken to run all M new tokens (an upper bound
                      on the waves' length; rows that stop early free their blocks sooner), each step time a
                      roofline lower bound. Attention's own flops and the prefill's weight reads are not counted.
    K engines         each takes ceil(rows / K) rows; K is the smallest count whose time is within the training
                      bound (the training programs' roofline bound per step): with async rollouts generation
                      overlaps training, so this is the count at which generation stops being the step's
                      longer half. None when even one row per engine is slower than the bound, or there is no
                      bound (a cpu:N target has no chip).
"""

from __future__ import annotations

import math

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.model.qwen2 import param_count
from twocircuit_jax.plan.chips import GPUS, GiB, GpuChip
from twocircuit_jax.plan.table import seconds, size

# vLLM's LLM-class defaults by device (vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args,
# vLLM 0.32): GPUs of 70 GiB or more other than the A100 get max_num_seqs 1024 and max_num_batched_tokens 16384,
# the rest 256 and 8192. Other vLLM versions may differ.
VLLM_DEFAULTS = {"h100-80gb": (1024, 16384), "h200": (1024, 16384), "a100-80gb": (256, 8192), "l40s": (256, 8192)}
OVERHEAD_BYTES = 1 * GiB
_BYTES = {"float32": 4, "bfloat16": 2}


def gpu(name: str) -> GpuChip:
    """The GPU named by `--sampler-chip`; a ConfigError naming the flag and the allowed names otherwise."""
    if name not in GPUS:
        got = f"got {name!r}" if name else "required with sampler.backend: vllm (the GPU its engines run on)"
        raise ConfigError("--sampler-chip", f"{got}; allowed: {', '.join(GPUS)}")
    return GPUS[name]


def engine_dtype(cfg) -> str:
    """The dtype the vLLM engine loads and caches in: what train/setup.py passes the server."""
    return cfg.model.param_dtype if cfg.sampler.dtype == "auto" else cfg.sampler.dtype


def reserve(m, b: int, max_seqs: int, batched_tokens: int) -> dict:
    """Bytes vLLM keeps outside the KV cache besides the weights: the module docstring's three terms."""
    width = 3 * m.intermediate_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 2 * m.hidden_size
    parts = {
        "overhead": float(OVERHEAD_BYTES),
        "activations": float(batched_tokens * width * b),
        "logits": float(2 * max_seqs * m.vocab_size * 4),
    }
    parts["total"] = sum(parts.values())
    return parts


def decode_step(r: int, weights: float, kv_row_avg: float, flops_per_row: float, peak: float, bw: float) -> dict:
    """Roofline of one token step of `r` rows: every weight read once, each row's KV at its average length."""
    t = {"bytes": weights + r * kv_row_avg, "flops": r * flops_per_row}
    t["hbm_s"], t["compute_s"] = t["bytes"] / bw, t["flops"] / peak
    t["bound_s"] = max(t["hbm_s"], t["compute_s"])
    t["limit"] = "hbm" if t["hbm_s"] >= t["compute_s"] else "compute"
    return t


def engine_plan(cfg, gpu_name: str, train_bound_s: float | None) -> dict:
    """The module docstring's numbers for `cfg` served by vLLM on `gpu_name` (a key of chips.GPUS), against
    `train_bound_s` (seconds per step; None: per-engine time only). A plain dict, written into the plan's JSON."""
    chip, m = gpu(gpu_name), cfg.model
    dtype = engine_dtype(cfg)
    b = _BYTES[dtype]
    peak = chip.peak_bf16_flops if dtype == "bfloat16" else chip.peak_fp32_flops
    bw = chip.memory_bytes_per_s
    P, M = cfg.train.max_prompt_len, cfg.sampler.sampling.max_new_tokens
    N = param_count(m)
    weights = float(N * b)
    kv_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * b
    kv_row = kv_token * (P + M)
    max_seqs, batched_tokens = VLLM_DEFAULTS[gpu_name]
    res = reserve(m, b, max_seqs, batched_tokens)
    budget = cfg.sampler.gpu_memory_utilization * chip.memory_bytes
    kv_cache = budget - weights - res["total"]
    kv_rows = max(0, math.floor(kv_cache / kv_row))
    R = min(kv_rows, max_seqs)
    rows = cfg.train.prompts_per_step * cfg.sampler.n
    d = {
        "gpu": gpu_name,
        "chip": chip._asdict(),
        "dtype": dtype,
        "params": N,
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "prompt_tokens": P,
        "new_tokens": M,
        "kv_bytes_per_row": kv_row,
        "gpu_memory_utilization": cfg.sampler.gpu_memory_utilization,
        "memory_budget_bytes": budget,
        "reserve": res,
        "kv_cache_bytes": kv_cache,
        "kv_rows": kv_rows,
        "max_num_seqs": max_seqs,
        "concurrent_rows": R,
        "fits": R > 0,
        "step_rows": rows,
        "train_bound_s": train_bound_s,
    }
    if R == 0:
        short = kv_row - kv_cache
        d["note"] = f"does not fit: the KV cache is {short / GiB:.2f} GiB short of one row"
        return d

    def wave_s(r: int) -> float:
        if r == 0:
            return 0.0
        prefill = 2.0 * N * r * P / peak
        return prefill + M * decode_step(r, weights, kv_token * (P + M / 2), 2.0 * N, peak, bw)["bound_s"]

    def engine_s(r: int) -> float:  # r rows through one engine, in waves of R; never shorter for more rows
        return (r // R) * wave_s(R) + wave_s(r % R)

    d["wave_rows"] = w = min(R, rows)  # the rows of a full wave of this step
    d["decode_step"] = decode_step(w, weights, kv_token * (P + M / 2), 2.0 * N, peak, bw)
    d["prefill_s"] = 2.0 * N * w * P / peak
    d["wave_s"] = wave_s(w)
    d["waves"] = math.ceil(rows / R)
    d["generation_s"] = engine_s(rows)
    d["engines"] = d["engine_rows"] = d["engines_generation_s"] = None
    if train_bound_s is None:
        d["note"] = "no training bound (the target has no chip): per-engine time only"
        return d
    for k in range(1, rows + 1):
        if engine_s(math.ceil(rows / k)) <= train_bound_s:
            r = math.ceil(rows / k)
            d["engines"], d["engine_rows"], d["engines_generation_s"] = k, r, engine_s(r)
            return d
    d["note"] = f"no engine count is within the training bound: one row alone takes {wave_s(1):.2f} s"
    return d


def render_engines(d: dict) -> str:
    """A few lines of `engine_plan`'s result for the plan's console report."""
    P, M = d["prompt_tokens"], d["new_tokens"]
    out = [
        f"vLLM sampler on {d['gpu']} ({d['chip']['name']}), {d['dtype']} weights and KV; estimates from shapes "
        "and datasheet numbers (plan/engines.py)",
        f"  per engine: weights {size(d['weight_bytes'])} ({d['params'] / 1e6:,.2f} M params), "
        f"KV {d['kv_bytes_per_token']:,} B/token, {size(d['kv_bytes_per_row'])}/row at {P:,} + {M:,} tokens",
        f"  memory: {d['gpu_memory_utilization']:g} x {size(d['chip']['memory_bytes'])} - weights "
        f"{size(d['weight_bytes'])} - reserve {size(d['reserve']['total'])} = KV cache {size(d['kv_cache_bytes'])}"
        f" -> {d['kv_rows']:,} rows fit, {d['concurrent_rows']:,} at once (vLLM's max_num_seqs {d['max_num_seqs']:,})",
    ]
    if not d["fits"]:
        out.append(f"  DOES NOT FIT: {d['note']}")
        return "\n".join(out)
    s = d["decode_step"]
    out.append(
        f"  decode step {seconds(s['bound_s'])} at {d['wave_rows']:,} rows ({s['limit']}); prefill "
        f"{seconds(d['prefill_s'])} per wave (flops bound)"
    )
    out.append(
        f"  one engine: {d['step_rows']:,} rows in {d['waves']:,} wave{'s' * (d['waves'] > 1)}, "
        f"{seconds(d['generation_s'])} per step "
        f"(every row runs all {M:,} new tokens)"
    )
    if d["engines"] is not None:
        out.append(
            f"  engines: {d['engines']:,} keep generation within the training bound {seconds(d['train_bound_s'])} "
            f"({d['engine_rows']:,} rows each, {seconds(d['engines_generation_s'])})"
        )
    else:
        out.append(f"  engines: {d['note']}")
    return "\n".join(out)

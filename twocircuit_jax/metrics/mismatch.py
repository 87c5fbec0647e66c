"""Sampler-trainer mismatch metrics (design §6), pure jnp over response tokens; jit-safe (no data-dependent keys).

Inputs are [B, T] with a float `mask` (1 on response tokens): ℓ_old = trainer log-prob (codec view),
ℓ_s = sampler log-prob, Δ = ℓ_old − ℓ_s, ρ = e^Δ. Positions outside the mask are replaced by 0 before any exp,
so padding garbage (even -inf) cannot leak in.

Every metric is also reported over truncated and finished rows (suffix `/truncated`, `/finished`) when
`truncated` [B] is given. A split (or a batch) without tokens gives NaN, which the host drops when logging
(`metrics.gauges.to_floats`); NaN marks "no data" rather than a fake 0.

Sequence-level quantities (chi2_seq, ppl) average over rows that have at least one response token. Perplexities
follow verl's rollout-correction metrics: per-row exp(−mean ℓ), averaged over rows; `log_ppl_diff` is the row mean
of (mean ℓ_s − mean ℓ_old) = log ppl_train − log ppl_roll.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

PREFIX = "mismatch/"
NAN = jnp.nan


def _mean(x, m, n):
    return jnp.sum(x * m) / jnp.maximum(n, 1.0)


def _lse_mean(a, b, n):
    """log(Σ b·e^a / n), stable for large a (long sequences make Σ Δ large)."""
    return jax.nn.logsumexp(jnp.where(b > 0, a, -jnp.inf), b=b) - jnp.log(jnp.maximum(n, 1.0))


def _stats(lo, ls, m, log_w):
    """All metrics over the tokens where m > 0 (lo, ls already zeroed outside m)."""
    n = jnp.sum(m)
    po, ps = jnp.exp(lo), jnp.exp(ls)
    gap = jnp.abs(po - ps)
    gap_mean = _mean(gap, m, n)
    out = {
        "prob_gap_mean": gap_mean,
        "prob_gap_max": jnp.max(jnp.where(m > 0, gap, -jnp.inf)),
        "prob_gap_std": jnp.sqrt(_mean((gap - gap_mean) ** 2, m, n)),
    }
    mo, ms = _mean(po, m, n), _mean(ps, m, n)
    cov = _mean((po - mo) * (ps - ms), m, n)
    den = jnp.sqrt(_mean((po - mo) ** 2, m, n) * _mean((ps - ms) ** 2, m, n))
    # Constant probabilities on either side leave the correlation undefined: NaN, not a fake 0.
    out["prob_corr"] = jnp.where(den > 0, jnp.clip(cov / jnp.where(den > 0, den, 1.0), -1.0, 1.0), NAN)

    d = lo - ls
    out["kl_k1"] = _mean(-d, m, n)
    out["kl_k3"] = _mean(jnp.expm1(d) - d, m, n)
    out["E_rho"] = _mean(jnp.exp(d), m, n)
    out["chi2_token"] = jnp.exp(_lse_mean(2 * d, m, n)) - 1.0

    rows = (jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    n_rows = jnp.sum(rows)
    seq_d = jnp.sum(d * m, axis=1)
    out["chi2_seq"] = jnp.exp(_lse_mean(2 * seq_d, rows, n_rows)) - 1.0

    # ESS = (Σw)² / (N Σw²), in logs so exp-overflowing weights still give a value (it is scale-free).
    log_w = jnp.where(m > 0, log_w, 0.0)
    out["ess"] = jnp.exp(2 * _lse_mean(log_w, m, n) - _lse_mean(2 * log_w, m, n))

    per_row_n = jnp.maximum(jnp.sum(m, axis=1), 1.0)
    mean_lo, mean_ls = jnp.sum(lo * m, axis=1) / per_row_n, jnp.sum(ls * m, axis=1) / per_row_n
    out["ppl_train"] = _mean(jnp.exp(-mean_lo), rows, n_rows)
    out["ppl_roll"] = _mean(jnp.exp(-mean_ls), rows, n_rows)
    out["log_ppl_diff"] = _mean(mean_ls - mean_lo, rows, n_rows)
    return {k: jnp.where(n > 0, v, NAN).astype(jnp.float32) for k, v in out.items()}


def mismatch_metrics(
    logp_old, logp_sampler, mask, truncated=None, weights: Optional[jnp.ndarray] = None, prefix: str = PREFIX
) -> dict:
    """`mismatch/*` scalars from trainer (`logp_old`) and sampler log-probs, [B, T] each.

    weights: the importance weights in use for `mismatch/ess` ([B, T] or [B, 1], e.g. TIS-capped); default ρ.
    truncated: [B] bool; adds the `/truncated` and `/finished` splits.
    """
    m = jnp.asarray(mask, jnp.float32)
    lo = jnp.where(m > 0, jnp.asarray(logp_old, jnp.float32), 0.0)
    ls = jnp.where(m > 0, jnp.asarray(logp_sampler, jnp.float32), 0.0)
    if weights is None:
        log_w = lo - ls
    else:
        w = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), m.shape)
        log_w = jnp.log(jnp.where(m > 0, jnp.maximum(w, 1e-30), 1.0))  # a masked token's weight is 0
    suffixes, masks = [""], [m]
    if truncated is not None:
        t = jnp.asarray(truncated, jnp.float32)[:, None]
        suffixes += ["/truncated", "/finished"]
        masks += [m * t, m * (1.0 - t)]
    # The splits batched through one set of reductions (vmap): a third of the programs XLA compiles and runs.
    stats = jax.vmap(lambda sm: _stats(lo, ls, sm, log_w))(jnp.stack(masks))
    return {f"{prefix}{k}{suffix}": v[i] for k, v in stats.items() for i, suffix in enumerate(suffixes)}


BY_TURN = ("prob_gap_mean", "prob_corr", "kl_k3")


def mismatch_by_turn(logp_old, logp_sampler, mask, row_turn) -> dict:
    """Multi-turn rows: `mismatch/turn{k}/{prob_gap_mean,prob_corr,kl_k3}` over the rows of interaction k, for each
    k that has rows (`row_turn` [B] int, -1 = empty row). Does later context widen the sampler-trainer gap?"""
    row_turn = np.asarray(row_turn)
    m = jnp.asarray(mask, jnp.float32)
    out = {}
    for k in sorted({int(x) for x in row_turn if x >= 0}):
        mk = m * jnp.asarray(row_turn == k, jnp.float32)[:, None]
        stats = mismatch_metrics(logp_old, logp_sampler, mk, prefix=f"{PREFIX}turn{k}/")
        out.update({f"{PREFIX}turn{k}/{s}": stats[f"{PREFIX}turn{k}/{s}"] for s in BY_TURN})
    return out

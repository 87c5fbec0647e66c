"""fp32 orthonormalisation shared by the low-rank projector and gradient PowerSGD (design §3.3, §3.5).

`orth(V)` returns Q [n, r] with orthonormal columns spanning V where V has rank, with a deterministic sign
(diag(R) >= 0), so replicas that orthonormalise the same summed V get bit-identical Q. Degenerate columns
(zero, duplicate, non-finite) are refilled from a seeded normal frame and re-orthonormalised against the good
columns, so the result always has r orthonormal columns and never depends on round-off noise directions.

Why fp32 always: JAX has no bf16 QR, and a bf16 basis loses orthogonality (QQᵀ stops being a projector).

Degeneracy threshold: a column i is degenerate when |R_ii| <= eps · max_j ‖V_j‖ (column norms of the input),
and every column is degenerate when V == 0. The design (§3.3) writes the threshold as `|R_ii| <= reortho_eps`; we scale it
by the largest input column norm so the repair is scale-invariant: sketches (ΣMᵀMQ ~ 1e6) and LM gradients
(P ~ 1e-8) must be judged alike. Documented departure; eps keeps its meaning of "relative loss of rank".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_FRAME_SEED = 0x5EED  # fixed: the refill frame must be the same on every replica


def _frame(n: int, r: int, key) -> jax.Array:
    """Deterministic refill directions [n, r] f32 (a normal draw; full rank with probability 1)."""
    if key is None:
        key = jax.random.PRNGKey(DEFAULT_FRAME_SEED)
    return jax.random.normal(key, (n, r), jnp.float32)


def _sanitize(V) -> tuple[jax.Array, jax.Array]:
    V = jnp.asarray(V).astype(jnp.float32)
    if V.ndim != 2:
        raise ValueError(f"orth expects a matrix [n, r]; got shape {V.shape}")
    n, r = V.shape
    if r > n:
        raise ValueError(f"orth: rank r={r} exceeds the dimension n={n}; cannot have r orthonormal columns")
    V = jnp.where(jnp.isfinite(V), V, 0.0)
    scale = jnp.max(jnp.linalg.norm(V, axis=0)) if r > 0 else jnp.float32(0)
    return V, scale


def _qr_signfix(V: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reduced QR with columns flipped so that diag(R) >= 0. Returns (Q, |diag R|)."""
    Q, R = jnp.linalg.qr(V, mode="reduced")
    d = jnp.diagonal(R)
    sign = jnp.where(d < 0, -1.0, 1.0).astype(jnp.float32)
    return Q * sign[None, :], jnp.abs(d)


def _orth_qr(V, scale, eps, key):
    n, r = V.shape
    Q, absd = _qr_signfix(V)
    bad = absd <= eps * scale
    # Repair: good columns first (already orthonormal, QR keeps them up to round-off), frame columns after,
    # so each refill is orthogonalised against the good span and earlier refills; then undo the permutation.
    order = jnp.argsort(bad.astype(jnp.int32), stable=True)
    inv = jnp.argsort(order, stable=True)
    W = jnp.where(bad[None, :], _frame(n, r, key), Q)
    Qr, _ = _qr_signfix(W[:, order])
    repaired = Qr[:, inv]
    # Only pay for the repair's effect when a column is bad: otherwise return the first QR bit for bit.
    return jnp.where(jnp.any(bad), repaired, Q)


def _orth_gs(V, scale, eps, key):
    """Gram–Schmidt (r <= 2, the PowerSGD rank-1/2 case): cheaper than QR and exactly the PowerSGD recipe."""
    n, r = V.shape
    F = _frame(n, r, key)
    cols = []
    for i in range(r):
        v = V[:, i]
        for q in cols:
            v = v - jnp.dot(q, v) * q
        norm = jnp.linalg.norm(v)
        f = F[:, i]
        for q in cols:  # refill candidate, orthogonal to what we already have
            f = f - jnp.dot(q, f) * q
        f = f / jnp.linalg.norm(f)
        bad = norm <= eps * scale
        cols.append(jnp.where(bad, f, v / jnp.where(bad, 1.0, norm)))
    return jnp.stack(cols, axis=1)


def orth(V, eps: float = 1e-6, key=None, *, method: str = "auto") -> jax.Array:
    """Orthonormal Q [n, r] f32 spanning V [n, r] (any dtype); see the module docstring.

    eps: degeneracy threshold relative to the largest input column norm. key: PRNG key of the refill frame
    (default: a fixed key, identical on every replica). method: "auto" (Gram–Schmidt for r <= 2, QR otherwise),
    "qr" or "gs". jit- and vmap-friendly; shapes are static.
    """
    V, scale = _sanitize(V)
    if method == "auto":
        method = "gs" if V.shape[1] <= 2 else "qr"
    if method == "gs":
        return _orth_gs(V, scale, eps, key)
    if method == "qr":
        return _orth_qr(V, scale, eps, key)
    raise ValueError(f"orth: method must be 'auto', 'qr' or 'gs'; got {method!r}")

"""orth and the low-rank activation codec (design §3.3): basis algebra, power iteration, staging, sketch masking."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from twocircuit_jax.fast.codecs.lowrank import (
    LowRankConfig,
    accumulate_sketch,
    activate_staged,
    basis_cond,
    host_seed,
    init_lowrank,
    lowrank_metrics,
    make_lowrank_hook,
    refresh_basis,
    stage,
)
from twocircuit_jax.fast.orth import orth
from twocircuit_jax.parallel import dispatch

H, R = 16, 3
CFG = LowRankConfig(rank=R, seed=5)


def _orthonormal(Q, tol=1e-5):
    np.testing.assert_allclose(np.asarray(Q.T @ Q), np.eye(Q.shape[1]), atol=tol)


@pytest.mark.parametrize("method", ["qr", "gs"])
def test_orth_orthonormal_sign_and_span(method):
    r = 2 if method == "gs" else 4
    V = jax.random.normal(jax.random.PRNGKey(0), (12, r))
    Q = orth(V, method=method)
    assert Q.dtype == jnp.float32
    _orthonormal(Q)
    R_ = Q.T @ V  # upper triangular with a non-negative diagonal after the sign fix
    assert np.all(np.diag(np.asarray(R_)) > 0)
    np.testing.assert_allclose(np.asarray(jnp.tril(R_, -1)), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(Q @ R_), np.asarray(V), atol=1e-5)
    # bf16 input is orthonormalised in fp32, never by a bf16 QR.
    assert orth(V.astype(jnp.bfloat16), method=method).dtype == jnp.float32


@pytest.mark.parametrize("method", ["qr", "gs"])
def test_orth_repairs_degenerate_columns(method):
    v = jax.random.normal(jax.random.PRNGKey(1), (10,))
    if method == "qr":
        V = jnp.stack([v, 2 * v, jnp.zeros(10), jnp.full(10, jnp.nan)], axis=1)  # duplicate, zero, non-finite
    else:
        V = jnp.stack([v, -3 * v], axis=1)
    Q = orth(V, method=method)
    assert bool(jnp.all(jnp.isfinite(Q)))
    _orthonormal(Q)
    np.testing.assert_allclose(np.asarray(Q[:, 0]), np.asarray(v / jnp.linalg.norm(v)), atol=1e-6)  # good kept
    np.testing.assert_array_equal(np.asarray(orth(V, method=method)), np.asarray(Q))  # deterministic
    Z = orth(jnp.zeros((10, V.shape[1])), method=method)  # all-zero input: the whole frame
    _orthonormal(Z)
    with pytest.raises(ValueError, match="exceeds"):
        orth(jnp.ones((3, 4)))


def test_init_basis_seed_and_cond():
    st = init_lowrank(CFG, H, [1, 3])
    assert set(st.Q) == {1, 3} and st.Q[1].shape == (H, R) and st.Q[1].dtype == jnp.float32
    _orthonormal(st.Q[1])
    assert host_seed(5, 3) == (5 * 1_000_003 + 3 * 7_919) & 0x7FFFFFFF
    again = init_lowrank(CFG, H, [1, 3])
    np.testing.assert_array_equal(np.asarray(st.Q[3]), np.asarray(again.Q[3]))
    assert not np.allclose(np.asarray(st.Q[1]), np.asarray(st.Q[3]))
    assert abs(float(basis_cond(st.Q[1])) - 1) < 1e-4
    assert float(basis_cond(jnp.zeros((H, R)).at[0, 0].set(1))) == np.inf


def test_hook_reconstructs_projection_and_gradient():
    st = init_lowrank(CFG, H, [1])
    hook = make_lowrank_hook(st, [1], sketch=True)
    h = jax.random.normal(jax.random.PRNGKey(2), (2, 5, H))
    out, aux = hook(1, h)
    Q = st.Q[1]
    np.testing.assert_allclose(np.asarray(out), np.asarray(h @ Q @ Q.T), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(aux["sketch"]), np.asarray(h.reshape(-1, H).T @ (h.reshape(-1, H) @ Q)), rtol=1e-5, atol=1e-4
    )
    want = jnp.linalg.norm(h - h @ Q @ Q.T) / jnp.linalg.norm(h)
    np.testing.assert_allclose(float(aux["recon_rel_err"]), float(want), rtol=1e-5)
    g = jax.random.normal(jax.random.PRNGKey(3), h.shape)
    dh = jax.grad(lambda x: jnp.sum(hook(1, x)[0] * g))(h)  # backward wire message: grad·QQᵀ
    np.testing.assert_allclose(np.asarray(dh), np.asarray(g @ Q @ Q.T), atol=1e-5)
    with pytest.raises(ValueError, match="not a boundary"):
        hook(2, h)
    with pytest.raises(RuntimeError, match="interpret"):
        make_lowrank_hook(st, [1], sketch=False, use_kernel=True)


def test_sketch_excludes_padding():
    st = init_lowrank(CFG, H, [1])
    h = jax.random.normal(jax.random.PRNGKey(4), (2, 6, H))
    mask = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    _, aux = make_lowrank_hook(st, [1], sketch=True, attention_mask=mask)(1, h)
    poisoned = jnp.where(mask[..., None] > 0, h, 1e3)  # padding values must not matter at all
    _, aux_p = make_lowrank_hook(st, [1], sketch=True, attention_mask=mask)(1, poisoned)
    np.testing.assert_array_equal(np.asarray(aux["sketch"]), np.asarray(aux_p["sketch"]))
    assert float(aux["tokens"]) == 8.0
    real = h[mask > 0]
    np.testing.assert_allclose(np.asarray(aux["sketch"]), np.asarray(real.T @ (real @ st.Q[1])), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(float(aux["recon_rel_err"]), float(aux_p["recon_rel_err"]), rtol=1e-6)
    _, aux_dense = make_lowrank_hook(st, [1], sketch=True, encode=False)(1, h)  # anchor view: h unchanged
    assert not np.allclose(np.asarray(aux_dense["sketch"]), np.asarray(aux["sketch"]))


def test_power_iteration_converges_to_top_subspace():
    # Activations with a clear rank-R dominant subspace plus small noise.
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(6), 3)
    U = orth(jax.random.normal(k1, (H, R)))
    M = (jax.random.normal(k2, (64, R)) * jnp.array([10.0, 6.0, 4.0])) @ U.T + 0.05 * jax.random.normal(k3, (64, H))
    st = init_lowrank(CFG, H, [1])
    errs = []
    for _ in range(6):
        _, aux = make_lowrank_hook(st, [1], sketch=True)(1, M[None])
        st = activate_staged(refresh_basis(accumulate_sketch(st, {1: aux}), CFG))
        errs.append(float(aux["recon_rel_err"]))
    Q = st.Q[1]
    _orthonormal(Q)
    # Principal angles: ‖UᵀQ‖ singular values near 1 means span(Q) == span(U).
    s = jnp.linalg.svd(U.T @ Q, compute_uv=False)
    assert float(s.min()) > 0.999
    assert errs[-1] < 0.02 < errs[0]
    assert int(st.q_updates) == 6 and int(st.q_activations) == 6 and int(st.q_stage_overwrites) == 0


def test_staging_semantics_and_overwrites():
    st = init_lowrank(CFG, H, [1, 3])
    h = jax.random.normal(jax.random.PRNGKey(7), (1, 8, H))
    _, aux = make_lowrank_hook(st, [1, 3], sketch=True)(1, h)
    _, aux3 = make_lowrank_hook(st, [1, 3], sketch=True)(3, h)
    st1 = refresh_basis(accumulate_sketch(st, {1: aux, 3: aux3}), CFG)
    assert bool(st1.staged)
    np.testing.assert_array_equal(np.asarray(st1.Q[1]), np.asarray(st.Q[1]))  # not active before activate
    assert float(jnp.abs(st1.sketch[1]).max()) == 0  # V cleared
    st2 = stage(st1, {1: st.Q[1] * -1, 3: st.Q[3]})  # a second stage before activation
    assert int(st2.q_stage_overwrites) == 1
    st3 = activate_staged(st2)
    np.testing.assert_array_equal(np.asarray(st3.Q[1]), np.asarray(-st.Q[1]))
    assert int(st3.q_activations) == 1 and not bool(st3.staged)
    st4 = activate_staged(st3)  # nothing staged: no-op
    assert int(st4.q_activations) == 1
    np.testing.assert_array_equal(np.asarray(st4.Q[1]), np.asarray(st3.Q[1]))
    # No tokens sketched: refresh leaves everything (no random frame staged).
    st5 = refresh_basis(st4, CFG)
    assert not bool(st5.staged) and int(st5.q_updates) == int(st4.q_updates)
    # Cold start: the next power-iteration start is Q₀ again.
    cold = dataclasses.replace(CFG, warm_start=False)
    st6 = refresh_basis(accumulate_sketch(st4, {1: aux, 3: aux3}), cold)
    np.testing.assert_array_equal(np.asarray(st6.Q_start[1]), np.asarray(st.Q_init[1]))
    assert set(lowrank_metrics(st6, {1: aux})) >= {"codec/basis_cond", "codec/recon_rel_err"}


def test_refresh_sums_sketch_over_dp():
    # Each of 8 replicas sketches its own rows; the synced basis equals the one from all rows on one device.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    st = init_lowrank(CFG, H, [1])
    h = jax.random.normal(jax.random.PRNGKey(8), (8, 4, H))

    def body(hl):
        _, aux = make_lowrank_hook(st, [1], sketch=True)(1, hl)
        return refresh_basis(accumulate_sketch(st, {1: aux}), CFG, axis_name="data").Q_next[1]

    Qs = dispatch.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))(h)
    _, aux = make_lowrank_hook(st, [1], sketch=True)(1, h)
    Q1 = refresh_basis(accumulate_sketch(st, {1: aux}), CFG).Q_next[1]
    np.testing.assert_allclose(np.asarray(Qs), np.asarray(Q1), atol=1e-4)

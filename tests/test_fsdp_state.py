"""Everything sharded that can be (fsdp > 1): hierarchical PowerSGD (manual over `data` only, fsdp with XLA's
partitioner) against the data-only path on the same data replicas, and the per-device bytes of the train state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.config.sections import MeshConfig
from twocircuit_jax.fast.grad_fn import make_codec_grad_fn
from twocircuit_jax.fast.powersgd import PowerSGDCodec, PowerSGDConfig, powersgd_reference
from twocircuit_jax.parallel import dispatch, mesh as pmesh
from twocircuit_jax.step.circuit_state import CircuitState, init_clock

L, H, F, V, B, T = 2, 16, 24, 40, 16, 3
# Parameter paths the mesh rules (parallel/mesh.py) shard over fsdp: q_proj on its rows, o_proj on its columns,
# embed on its columns, lm_head on its rows; the per-layer norm and the final norm stay replicated.
SHAPES = {
    "embed": (V, H),
    "final_norm": (H,),
    "layers": {"norm": {"scale": (L, H)}, "o_proj": {"kernel": (L, F, H)}, "q_proj": {"kernel": (L, H, F)}},
    "lm_head": (H, V),
}


def _params(seed=0):
    leaves, tree = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def _batch(seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    mask = (jax.random.uniform(k2, (B, T)) > 0.3).astype(jnp.float32)  # unequal token counts per replica
    return {"x": jax.random.normal(k1, (B, H)), "response_mask": mask}


def loss_fn(params, batch, cs):
    """A small network that reads every parameter; the loss is a global-token mean (grad_fn's normalisers)."""
    x = batch["x"]
    for layer in range(L):
        h = jnp.tanh(x @ params["layers"]["q_proj"]["kernel"][layer]) @ params["layers"]["o_proj"]["kernel"][layer]
        x = x + h * params["layers"]["norm"]["scale"][layer]
    logits = (x * params["final_norm"]) @ params["lm_head"] + 0.1 * (x @ params["embed"].T)
    per_row = jnp.sum(jnp.tanh(logits) ** 2, -1) * jnp.sum(batch["response_mask"], -1)
    return jnp.sum(per_row) / batch["token_count"], {"logit_mean": jnp.mean(logits)}, {}


def _mesh(data, fsdp, tensor=1):
    return pmesh.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor])


def _step_fn(mesh, cfg):
    """jit(grad_fn) on `mesh` with the loop's shardings: params by the mesh rules, batch over data x fsdp, the codec
    state by its global specs. Returns (run(params, batch, grad_state) -> (mean, loss, metrics, grad_state), codec,
    param shardings, grad state shardings)."""
    codec = PowerSGDCodec(cfg, mesh=mesh)
    codec.check_mesh(mesh)
    params = _params()
    p_sh = pmesh.param_shardings(params, mesh)
    R = mesh.shape["data"] * (1 if codec.hierarchical else mesh.shape["fsdp"])
    st = codec.init(params, R)
    g_sh = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        codec.global_specs(st, pmesh.BATCH_AXES),
        is_leaf=lambda x: isinstance(x, P),
    )
    fn = make_codec_grad_fn(codec, mesh)(loss_fn)
    b_sh = pmesh.batch_shardings(_batch(), mesh)

    def step(params, batch, grad):
        cs = CircuitState(init_clock(), None, grad, None, None)
        mean, loss, metrics, _, cs = fn(params, batch, cs)
        return mean, loss, metrics, cs.grad

    jitted = dispatch.jit(step, in_shardings=(p_sh, b_sh, g_sh), out_shardings=(p_sh, None, None, g_sh))
    return jitted, codec, p_sh, g_sh, st


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("data,fsdp,tensor,compress_embeddings", [(2, 4, 1, False), (4, 2, 1, True), (2, 2, 2, False)])
def test_hierarchical_powersgd_matches_data_only(data, fsdp, tensor, compress_embeddings):
    """Two ticks of the hierarchical step (data x fsdp) equal the data-only step (fsdp = 1) on the same data
    replicas' rows: mean gradient, loss, Q and each replica's error memory, to fp32 round-off; the state and the
    mean come back sharded over fsdp like the parameters, and e per replica too."""
    cfg = PowerSGDConfig(rank=2, start_after=1, min_compression_rate=1.0, compress_embeddings=compress_embeddings)
    hier, codec, p_sh, g_sh, st_h = _step_fn(_mesh(data, fsdp, tensor), cfg)
    ref, codec_r, _, _, st_r = _step_fn(_mesh(data, 1), cfg)
    assert codec.hierarchical and not codec_r.hierarchical and codec.replica_axes == ("data",)
    params, batch = _params(), _batch()
    for tick in range(3):  # tick 0: the plain-mean warm-up; ticks 1, 2: compressed (Q warm-started from tick 1)
        mh, lh, met_h, st_h = hier(params, batch, st_h)
        mr, lr, met_r, st_r = ref(params, batch, st_r)
        _close(mh, mr)
        _close(st_h.e, st_r.e)
        _close(st_h.Q, st_r.Q)
        np.testing.assert_allclose(float(lh), float(lr), rtol=1e-5)
        assert float(met_h["powersgd/compressed"]) == float(tick >= 1)
        for k in ("powersgd/bytes_compressed", "powersgd/bytes_dense"):  # per data replica, the same logical bytes
            assert float(met_h[k]) == float(met_r[k])
        np.testing.assert_allclose(float(met_h["powersgd/error_norm"]), float(met_r["powersgd/error_norm"]), 1e-5)
        params = jax.tree.map(lambda p, g: np.asarray(p) - 0.1 * np.asarray(g), params, mr)  # a new gradient
    assert float(jnp.sum(jnp.abs(st_h.e["layers/q_proj/kernel"]))) > 0  # the error memory is live
    # Shardings: the mean like the params, e split over data then like its parameter.
    for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(mh), jax.tree.leaves(p_sh)):
        assert x.sharding.is_equivalent_to(sh, x.ndim), path
    e = st_h.e["layers/q_proj/kernel"]  # [data·L, H, F]: H over fsdp, F over tensor
    assert e.sharding.shard_shape(e.shape) == (L, H // fsdp, F // tensor)
    e = st_h.e["layers/o_proj/kernel"]  # [data·L, F, H]: F over tensor, H over fsdp
    assert e.sharding.shard_shape(e.shape) == (L, F // tensor, H // fsdp)


def test_reference_math_single_device():
    """The hierarchical step equals `powersgd_reference` (a Python loop over the replicas, one device) fed with each
    data replica's own gradient of its rows: the same PowerSGD math, not just the same as the other mesh. (The
    first parametrization's config and mesh, so the program is the one compiled there, read back from the compile
    cache; the state enters at step 1, past the warm-up: a compressed reduce.)"""
    data, fsdp = 2, 4
    cfg = PowerSGDConfig(rank=2, start_after=1, min_compression_rate=1.0)
    hier, codec, _, _, st = _step_fn(_mesh(data, fsdp), cfg)
    st = st._replace(step=jnp.ones((), jnp.int32))
    params, batch = _params(), _batch()
    rows = B // data
    glob = {"token_count": jnp.sum(batch["response_mask"]) / data}
    grads = [
        jax.grad(
            lambda p: loss_fn(p, dict(jax.tree.map(lambda x: x[i * rows : (i + 1) * rows], batch), **glob), None)[0]
        )(params)
        for i in range(data)
    ]
    want, want_st, want_m = powersgd_reference(grads, st, cfg)
    mean, _, met, got_st = hier(params, batch, st)
    _close(mean, want, 2e-5)
    _close(got_st.e, want_st.e, 2e-5)
    _close(got_st.Q, want_st.Q, 2e-5)
    np.testing.assert_allclose(float(met["powersgd/error_norm"]), want_m["powersgd/error_norm"], atol=1e-6)
    assert float(met["powersgd/compressed"]) == want_m["powersgd/compressed"] == 1.0


def test_data_one_with_fsdp_is_refused():
    """data = 1 leaves PowerSGD nothing to compress: a clear error naming the mesh sizes and the alternative."""
    codec = PowerSGDCodec(PowerSGDConfig(), mesh=_mesh(1, 8))
    with pytest.raises(ValueError, match="data=1 and fsdp=8.*grad_codec.type=none"):
        codec.check_mesh(codec.mesh)
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.fast.circuit import FastCircuit

    cfg = _run_cfg(1, 8)
    with pytest.raises(ConfigError, match="fast.grad_codec.*data=1 and fsdp=8"):
        FastCircuit(cfg, cfg.model, pmesh.make_mesh(cfg.mesh, jax.devices()))
    codec = PowerSGDCodec(PowerSGDConfig(use_kernel=True), mesh=_mesh(2, 4))
    with pytest.raises(ValueError, match="use_kernel=true needs mesh.fsdp=1"):
        codec.check_mesh(codec.mesh)


# ------------------------------------------------------------------------------ the compiled train step's state
def _run_cfg(data, fsdp, **anchor):
    from tiny_run import tiny_config

    from twocircuit_jax.config.run import load_config

    fast = {"pp_size": 2, "grad_codec": {"type": "powersgd", "rank": 2, "start_after": 0}}
    raw = tiny_config(mesh={"data": data, "fsdp": fsdp}, fast=fast, anchor={"enabled": bool(anchor), **anchor})
    return load_config(data=raw)


def _shard_bytes(tree, shardings) -> int:
    return sum(
        int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
    )


def _check_split(tree, shardings, fsdp, *, lead=1):
    """Every weight matrix's shard is the full leaf divided by `fsdp` along exactly one dim (by `lead` x fsdp on
    axis 0 when the leaf stacks `lead` replicas there, PowerSGD's e); returns the number of leaves checked."""
    n = 0
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(shardings)):
        name = jax.tree_util.keystr(path)
        if x.ndim < 2 or "norm" in name or "bias" in name:  # per-layer norms [L, H], biases: not fsdp-split
            continue
        full, shard = tuple(x.shape), s.shard_shape(x.shape)
        ratio = [f // d for f, d in zip(full, shard)]
        want = sorted([fsdp] + [1] * (x.ndim - 1)) if lead == 1 else None
        if lead == 1:
            assert sorted(ratio) == want, (name, full, shard)
        else:  # axis 0: the replica split times (maybe) fsdp; the rest: at most one fsdp split in all
            assert ratio[0] in (lead, lead * fsdp) and int(np.prod(ratio)) == lead * fsdp, (name, full, shard)
        n += 1
    return n


def test_train_step_state_bytes_fall_by_fsdp():
    """The compiled train step (shapes only, 8 fake CPU devices), data 2 x fsdp 4 against data 8: each param,
    Adam moment and PowerSGD error-memory matrix is split 4 ways over fsdp, and the per-device bytes of that
    state, and the step's argument bytes, fall ~4x."""
    from twocircuit_jax.step.abstract_step import abstract_train_step

    out = {}
    for data, fsdp in ((8, 1), (2, 4)):
        step = abstract_train_step(_run_cfg(data, fsdp), jax.devices())
        compiled = step.jitted.wrapped.lower(*step.args).compile()
        (state_sh, cs_sh, _), _ = compiled.input_shardings
        state, cs, _ = step.args
        assert step.circuit.grad_codec.hierarchical == (fsdp > 1)
        n_p = _check_split(state.params, state_sh.params, fsdp)
        n_o = _check_split(state.opt_state, state_sh.opt_state, fsdp)
        n_e = _check_split(cs.grad.e, cs_sh.grad.e, fsdp, lead=data)
        assert n_p >= 8 and n_o >= 2 * n_p and n_e >= 7  # 7 stacked kernels + embed; Adam mu, nu; e: kernels
        out[fsdp] = {
            "params": _shard_bytes(state.params, state_sh.params),
            "adam": _shard_bytes(state.opt_state, state_sh.opt_state),
            "error": _shard_bytes(cs.grad.e, cs_sh.grad.e),
            "args": compiled.memory_analysis().argument_size_in_bytes,
        }
    for k in ("params", "adam", "error"):  # the norms (replicated, [H] or [L, H]) keep the ratio a little under 4
        assert 3.6 < out[1][k] / out[4][k] <= 4.0, (k, out)
    assert out[1]["args"] / out[4]["args"] > 3.3, out  # the batch and Q are per-device the same on both meshes


def test_anchor_state_sharded_like_params():
    """With the anchor on (merger and swap) on data 2 x fsdp 4: the merger's M, the anchor moments and the
    reference parameters are placed like the parameters (each matrix split 4 ways), in the circuit and in the
    arrays the circuit builds."""
    from twocircuit_jax.anchor.circuit import AnchorCircuit
    from twocircuit_jax.model.qwen2 import init_params
    from twocircuit_jax.parallel.host import to_global

    cfg = _run_cfg(2, 4, merger={"type": "delayed_ef"}, swap={"cadence": 2})
    mesh = pmesh.make_mesh(cfg.mesh, jax.devices())
    host = jax.tree.map(np.asarray, init_params(cfg.model, jax.random.key(0)))
    p_sh = pmesh.param_shardings(host, mesh)
    params = to_global(host, p_sh)
    anchor = AnchorCircuit(cfg, cfg.model, params)
    merger, moments = anchor.init_merger_state(), anchor.init_moments()
    n_leaves = len(jax.tree.leaves(params))  # target_scope 'all': every leaf, norms and biases included
    assert set(merger.m) == set(moments.m) == set(merger.delta) and len(merger.m) == n_leaves
    for tree in (merger.m, merger.delta, moments.m, moments.v):  # 7 stacked kernels + embed split 4 ways
        assert _check_split(tree, jax.tree.map(lambda x: x.sharding, tree), 4) == 8
    for tree, sh in ((merger, anchor.merger_sh), (moments, anchor.mom_sh)):
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sh)):
            assert x.sharding.is_equivalent_to(s, x.ndim)
    ref = jax.tree.map(jnp.copy, to_global(host, p_sh))  # the loop's reference parameters (loop.py ref_params)
    assert _check_split(ref, jax.tree.map(lambda x: x.sharding, ref), 4) == _check_split(params, p_sh, 4)


# ----------------------------------------------------------------------------------- host buffers, counted
def test_rollout_ahead_held_compactly_and_counted():
    """The step-ahead rollouts are held with their 0/1 masks as uint8 and handed back bit-identical in their own
    dtypes; `host_bytes` equals the bytes actually held (hand count: 10 B per token, 13 B per row)."""
    from tiny_run import tiny_config

    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.train.rollout import Collected, pack_rows
    from twocircuit_jax.train.rollout_ahead import RolloutAhead, host_bytes

    cfg = load_config(data=tiny_config(train={"async_rollouts": 1}))
    rows, Tp, Tn = (
        cfg.train.prompts_per_step * cfg.sampler.n,
        cfg.train.max_prompt_len,
        cfg.sampler.sampling.max_new_tokens,
    )
    rng = np.random.default_rng(0)
    resp = [list(rng.integers(3, 50, rng.integers(1, Tn + 1))) for _ in range(rows)]
    batch = pack_rows([[5, 6, 7]] * rows, resp, [list(-rng.random(len(r))) for r in resp], [False] * rows, Tp, Tn, 0)
    batch.update(advantages=rng.standard_normal(rows).astype(np.float32), loss_mask=np.ones(rows, np.float32))
    col = Collected(batch, {}, [len(r) for r in resp], [False] * rows, 0, 0.0)
    ahead = RolloutAhead(threaded=False)
    ahead.start(3, lambda: col)
    held, dtypes = ahead._future.result()
    assert {k: held.batch[k].dtype for k in ("attention_mask", "response_mask")} == {
        "attention_mask": np.uint8,
        "response_mask": np.uint8,
    }
    assert sum(v.nbytes for v in held.batch.values()) == host_bytes(cfg)["rollout_ahead/bytes"]
    assert host_bytes(cfg)["rollout_ahead/bytes"] == rows * (Tp + Tn) * 10 + rows * 13
    blob = ahead.state_dict()
    got = ahead.take(3)
    for k, v in batch.items():
        assert got.batch[k].dtype == v.dtype and np.array_equal(got.batch[k], v), k
    ahead.load_state_dict(blob)  # a resume's copy is held compactly too and comes back the same
    assert ahead._future.result()[0].batch["response_mask"].dtype == np.uint8
    back = ahead.take(3).batch
    assert all(back[k].dtype == v.dtype and np.array_equal(back[k], v) for k, v in batch.items())
    ahead.close()
    assert host_bytes(load_config(data=tiny_config()))["rollout_ahead/bytes"] == 0


@pytest.mark.parametrize("cadence,delay,tps", [(4, 4, 2), (2, 8, 1), (3, 7, 4), (5, 20, 3)])
def test_anchor_snapshot_bound_is_tight_and_bytes_counted(cadence, delay, tps):
    """The replay buffer never holds more snapshots than `max_snapshots`, reaches it, and `host_bytes` counts each
    snapshot as the bytes `host_snapshot` actually stores (bf16 floats, int leaves as they are)."""
    from tiny_run import tiny_config

    from twocircuit_jax.anchor.retention import ReplayBuffer, host_bytes, host_snapshot, max_snapshots
    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.model.qwen2 import init_params

    buf = ReplayBuffer(cadence, delay, "bfloat16", ticks_per_step=tps)
    params = {"w": np.ones((3, 4), np.float32), "n": np.arange(5, dtype=np.int32)}
    most = 0
    for tau in range(1, 12 * (delay + cadence)):
        buf.on_tick(tau, (tau - 1) // tps + 1, {"t": tau}, params=params)
        most = max(most, buf.num_snapshots)
        if tau % cadence == 0:
            buf.replay_for_fire(tau)
    assert most == max_snapshots(cadence, delay, tps) <= min(delay // cadence, delay // tps) + 2

    raw = tiny_config(model={"param_dtype": "bfloat16"}, anchor={"enabled": True, "cadence": cadence, "delay": delay})
    cfg = load_config(data=raw)
    p = init_params(cfg.model, jax.random.key(0))
    hb = host_bytes(cfg)
    assert hb["anchor/snapshot_bytes"] == sum(x.nbytes for x in jax.tree.leaves(host_snapshot(p, "bfloat16")))
    assert (
        hb["anchor/host_bytes"]
        == (hb["anchor/snapshots"] + hb["anchor/window_snapshots"]) * hb["anchor/snapshot_bytes"]
    )


@pytest.mark.slow
def test_train_loop_hierarchical_powersgd_with_anchor(tmp_path):
    """`twocircuit train` on data 2 x fsdp 4 with PowerSGD (hierarchical) and the anchor (merger + swap): it runs,
    PowerSGD compresses after its warm-up, the merger applies, the logged gradient bytes are the per-data-replica
    formula, and the trainer's params, Adam moments, error memory, merger M and anchor moments stay split 4 ways."""
    import json

    import yaml
    from tiny_run import tiny_config

    from twocircuit_jax.cli import main
    from twocircuit_jax.fast import bytes as fbytes
    from twocircuit_jax.train import loop

    raw = tiny_config(
        mesh={"data": 2, "fsdp": 4},
        train={"steps": 3},
        fast={"pp_size": 2, "grad_codec": {"type": "powersgd", "rank": 2, "start_after": 1}},
        anchor={"enabled": True, "cadence": 2, "delay": 2, "projection": {"window": 2}, "swap": {"cadence": 2}},
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    seen, real = {}, loop.GRPOTrainer.run

    def keep(self):
        seen["t"] = self
        return real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop.GRPOTrainer, "run", keep)
        args = ["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "run"), "--no-progress"]
        assert main(args) == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1:]
    t = seen["t"]
    assert (
        t.built.fast.grad_codec.hierarchical and t.built.fast.grad_axes == ("data",) and t.built.fast.grad_replicas == 2
    )
    assert all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["powersgd/compressed"] == 1.0
    assert rows[-1]["merger/applied"] == 1.0
    c = (
        t.built.fast
    )  # per tick: PowerSGD's bytes of one data replica + the dense boundary activations of one batch shard
    grad = fbytes.powersgd_bytes(t.state.params, c.fcfg.grad_codec)["comm/bytes_compressed"]
    tokens = c.tokens_per_tick // 8
    act = fbytes.activation_bytes(c.fcfg.codec, tokens=tokens, hidden=c.model_cfg.hidden_size, boundaries=c.boundaries)
    assert rows[-1]["comm/bytes_compressed"] == pytest.approx((grad + act["comm/bytes_compressed"]) * c.ticks_per_step)
    params = t.state.params
    assert _check_split(params, jax.tree.map(lambda x: x.sharding, params), 4) == 8
    for tree in (t.state.opt_state, t.cs.merger.m, t.cs.moments.m, t.cs.moments.v, t.built.ref_params):
        assert _check_split(tree, jax.tree.map(lambda x: x.sharding, tree), 4) >= 8
    e = t.cs.grad.e
    assert _check_split(e, jax.tree.map(lambda x: x.sharding, e), 4, lead=2) == 7

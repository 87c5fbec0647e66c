"""Checkpoint manager: sharded bit-exact round trip, commit protocol, best-keeping, retention."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from twocircuit_jax.train.checkpoint import CheckpointManager


def _state(seed=0):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(seed)
    params = {
        "w": jax.device_put(jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), NamedSharding(mesh, P("dp", "tp"))),
        "e": jax.device_put(jnp.asarray(rng.normal(size=(4, 8)), jnp.bfloat16), NamedSharding(mesh, P(None, "tp"))),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    opt = optax.adamw(1e-3).init(params)
    return {
        "params": params,
        "opt": opt,
        "key": jax.random.PRNGKey(seed),
        "codec": {
            "basis": jax.device_put(
                jnp.asarray(rng.normal(size=(8, 2)), jnp.float32), NamedSharding(mesh, P("dp", None))
            )
        },
    }


def _leaves(t):
    return jax.tree_util.tree_leaves(t)


def test_sharded_round_trip_is_bit_exact(tmp_path):
    state = _state(1)
    state["opt"] = jax.tree_util.tree_map(lambda x: x + 0.5 if x.dtype != jnp.int32 else x + 7, state["opt"])
    cm = CheckpointManager(tmp_path)
    meta = {"tick": 12, "seed": 3, "cursor": [1, 2], "history": [{"step": 1, "reward/mean": 0.5}], "best": None}
    cm.save(5, state, meta)
    # restore into a target whose values differ: only structure/dtype/sharding come from it
    target = jax.tree_util.tree_map(jnp.zeros_like, state)
    got, got_meta = cm.restore(5, target)
    assert got_meta == meta
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(state)
    for a, b in zip(_leaves(got), _leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert isinstance(got["params"]["w"].sharding, NamedSharding)
    assert got["params"]["w"].sharding.spec == P("dp", "tp")
    # abstract target (ShapeDtypeStruct with sharding) works the same
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    got2, _ = cm.restore(5, abstract)
    assert np.asarray(got2["params"]["e"]).tobytes() == np.asarray(state["params"]["e"]).tobytes()


def test_half_written_checkpoints_are_ignored_and_cleaned(tmp_path):
    cm = CheckpointManager(tmp_path)
    state = _state()
    cm.save(1, state, {})
    cm.save(2, state, {})
    # crash after the rename but without the marker (simulated), and a crash mid-write (temp dir)
    os.remove(tmp_path / "step_00000002" / "COMMITTED")
    shutil.copytree(tmp_path / "step_00000001", tmp_path / ".tmp-step_00000003")
    assert cm.latest() == 1
    with pytest.raises(FileNotFoundError):
        cm.restore(2, state)
    cm2 = CheckpointManager(tmp_path)  # a restarted run cleans the debris
    assert cm2.latest() == 1
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]


def test_retention_keeps_last_n(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=2)
    state = _state()
    for s in (10, 20, 30, 40):
        cm.save(s, state, {"s": s})
    assert cm.steps() == [30, 40] and cm.latest() == 40
    assert cm.restore(30, state)[1] == {"s": 30}
    cm.save(40, state, {"s": "again"})  # re-saving a step (after a resume) replaces it
    assert cm.steps() == [30, 40] and cm.restore(40, state)[1] == {"s": "again"}


def test_best_kept_only_on_strictly_better_score(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=1)
    s1, s2 = _state(1), _state(2)
    assert cm.best_score() is None
    assert cm.save_best(3, s1, {"step": 3}, 0.4)
    assert not cm.save_best(4, s2, {"step": 4}, 0.3)  # worse
    assert not cm.save_best(5, s2, {"step": 5}, 0.4)  # equal is not better
    assert not cm.save_best(6, s2, {"step": 6}, float("nan"))
    for s in (4, 5, 6):
        cm.save(s, s2, {})  # retention never touches best
    got, meta = cm.restore("best", s1)
    assert meta == {"step": 3} and cm.best_score() == 0.4
    assert np.asarray(got["params"]["w"]).tobytes() == np.asarray(s1["params"]["w"]).tobytes()
    assert cm.save_best(7, s2, {"step": 7}, 0.5)
    got, meta = cm.restore("best", s1)
    assert meta == {"step": 7}
    assert np.asarray(got["params"]["w"]).tobytes() == np.asarray(s2["params"]["w"]).tobytes()
    assert json.loads((tmp_path / "best" / "COMMITTED").read_text()) == {"step": 7, "score": 0.5}
    assert sorted(os.listdir(tmp_path)) == ["best", "step_00000006"]


def test_crash_while_replacing_best_restores_old_best(tmp_path):
    cm = CheckpointManager(tmp_path)
    cm.save_best(1, _state(1), {"step": 1}, 0.2)
    os.rename(tmp_path / "best", tmp_path / ".tmp-old-best-deadbeef")  # crash between the two renames
    assert CheckpointManager(tmp_path).best_score() == 0.2
    assert sorted(os.listdir(tmp_path)) == ["best"]

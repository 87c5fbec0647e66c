"""Weight exports for the vLLM sampler: atomic versions, latest version, corrupt folders, bit-exact round trip."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model import init_params
from twocircuit_jax.sampler import export as ex

CFG = ModelConfig(
    vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48
)


def _params(seed=0, dtype="float32"):
    import dataclasses

    return init_params(dataclasses.replace(CFG, param_dtype=dtype), jax.random.PRNGKey(seed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bit_exact(tmp_path, dtype):
    params = _params(1, dtype)
    path = ex.export_weights(params, CFG, str(tmp_path), 3)
    assert path == os.path.join(str(tmp_path), "v00000003")
    cfg, restored = ex.load_export(path)
    assert cfg["hidden_size"] == 32 and cfg["num_layers"] == 2
    flat_a = jax.tree_util.tree_leaves_with_path(params)
    flat_b = jax.tree_util.tree_leaves_with_path(restored)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (p, a), (_, b) in zip(flat_a, flat_b):
        assert isinstance(b, np.ndarray), f"{p}: restored as {type(b)} (must be host numpy)"
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8), err_msg=str(p))


def test_versions_and_pruning(tmp_path):
    root = str(tmp_path)
    assert ex.list_versions(root) == []
    assert ex.list_versions(os.path.join(root, "nope")) == []
    params = _params()
    for v in (0, 1, 2, 5):
        ex.export_weights(params, CFG, root, v, keep=2)
    assert ex.list_versions(root) == [2, 5]
    assert ex.list_versions(root)[-1] == 5
    # A half-written folder (temporary name) is never a version.
    os.makedirs(os.path.join(root, ".tmp-v00000009-12345"))
    assert ex.list_versions(root)[-1] == 5


def test_export_is_atomic_on_failure(tmp_path):
    """A failing save leaves neither the final folder nor a temporary one behind."""
    bad = {"embed": object()}  # orbax cannot serialise this leaf
    with pytest.raises(Exception):
        ex.export_weights(bad, CFG, str(tmp_path), 4)
    assert os.listdir(str(tmp_path)) == []
    assert ex.list_versions(str(tmp_path)) == []


def test_reexport_replaces_version(tmp_path):
    root = str(tmp_path)
    ex.export_weights(_params(0), CFG, root, 1)
    p2 = _params(7)
    ex.export_weights(p2, CFG, root, 1)
    _, restored = ex.load_export(ex.version_dir(root, 1))
    np.testing.assert_array_equal(np.asarray(p2["embed"]), restored["embed"])


def test_missing_and_corrupt_folders(tmp_path):
    root = str(tmp_path)
    with pytest.raises(ex.ExportError, match="not found"):
        ex.load_export(ex.version_dir(root, 7))
    path = ex.export_weights(_params(), CFG, root, 7)
    os.remove(os.path.join(path, "meta.json"))
    with pytest.raises(ex.ExportError, match="meta.json.*missing"):
        ex.load_export(path)
    path = ex.export_weights(_params(), CFG, root, 8)
    with open(os.path.join(path, "meta.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(ex.ExportError, match="malformed"):
        ex.load_export(path)
    path = ex.export_weights(_params(), CFG, root, 9)
    # Garble every data file of the orbax checkpoint.
    for dirpath, _, files in os.walk(os.path.join(path, "params")):
        for f in files:
            with open(os.path.join(dirpath, f), "wb") as fh:
                fh.write(b"garbage")
    with pytest.raises(ex.ExportError, match="cannot restore"):
        ex.load_export(path)
    assert isinstance(jnp.zeros(1), jax.Array)  # jax still usable after the failures

"""Reading a policy (model config + params) from any of the three on-disk forms the project writes.

- a Hugging Face directory (config.json + safetensors): `twocircuit sft`, `export-hf`;
- a native directory (orbax params + meta.json): `import-hf`, the sampler's weight exports;
- a run checkpoint (`runs/NAME/checkpoints/step_XXXXXXXX` or `.../best`): the GRPO loop.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from twocircuit_jax.config.base import from_dict
from twocircuit_jax.config.sections import ModelConfig
from twocircuit_jax.model.hf_io import CheckpointError, load_hf


def load_policy(path: str):
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf(path)
    if os.path.isfile(os.path.join(path, "COMMITTED")):
        return _from_run_checkpoint(path)
    from twocircuit_jax.sampler.export import ExportError, load_export

    try:
        mcfg, params = load_export(path)
    except ExportError as e:
        raise CheckpointError(
            f"{path}: not a Hugging Face dir (no config.json), a run checkpoint (no COMMITTED) "
            f"or a native checkpoint ({e})"
        ) from None
    return from_dict(ModelConfig, mcfg), jax.tree.map(jnp.asarray, params)


def _from_run_checkpoint(path: str):
    import orbax.checkpoint as ocp

    meta_path = os.path.join(path, "meta.json")
    try:
        meta = json.loads(open(meta_path).read())
        mcfg = from_dict(ModelConfig, meta["model_config"])
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{meta_path}: unreadable or without model_config ({e})") from None
    # Restore into the saved structure, every array whole on this process's first device: a checkpoint written by
    # a multi-process run names devices (of other processes) that a restore by its saved shardings cannot find.
    # Costs one device's memory for the whole saved state (optimizer moments included), as a host restore did.
    ckptr = ocp.StandardCheckpointer()
    state_dir = os.path.abspath(os.path.join(path, "state"))
    saved = ckptr.metadata(state_dir).item_metadata.tree
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree = ckptr.restore(state_dir, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved))
    train = tree["train"]
    params = train["params"] if isinstance(train, dict) else train[0]
    return mcfg, jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)


def save_native(cfg: ModelConfig, params, out_dir: str, overwrite: bool = False) -> str:
    """`import-hf` output: the same layout as a sampler weight export (version 0). Someone else's non-empty folder
    is refused unless `overwrite`; only the files written here replace their namesakes (outdir.install)."""
    import shutil
    import tempfile

    from twocircuit_jax import outdir
    from twocircuit_jax.sampler.export import export_weights, version_dir

    out_dir = os.path.abspath(out_dir)
    if outdir.foreign(out_dir) and not overwrite:
        raise CheckpointError(f"{out_dir}: not empty and not written by twocircuit; choose a new --out or --overwrite")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-import-", dir=parent)
    try:
        export_weights(params, cfg, tmp, 0)
        outdir.install(version_dir(tmp, 0), out_dir, "native", overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

"""Hugging Face checkpoints in and out: config.json + *.safetensors (one file or several with an index)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np

from twocircuit_jax.config.base import ConfigError, from_dict
from twocircuit_jax.config.sections import ModelConfig

SUPPORTED = ("qwen2", "qwen3")
_PROJ = {  # our name -> (HF module path, transpose)
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
HF_NORMS = {
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read: names the file and what is wrong."""


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise CheckpointError(f"{source}: model_type is {mt!r}; supported: {', '.join(SUPPORTED)}")
    try:
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        eos = hf.get("eos_token_id", 2)
        data = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=H,
            num_layers=hf["num_hidden_layers"],
            num_heads=nh,
            num_kv_heads=hf.get("num_key_value_heads", nh),
            head_dim=hf.get("head_dim") or H // nh,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or bool(hf.get("attention_bias", False)),
            qk_norm=(mt == "qwen3"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            eos_token_id=eos[0] if isinstance(eos, list) else (eos if eos is not None else 2),
            pad_token_id=hf.get("pad_token_id") or 0,
            bos_token_id=hf.get("bos_token_id"),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
    try:
        return from_dict(ModelConfig, data)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    mt = "qwen3" if cfg.qk_norm else "qwen2"
    return {
        "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM"],
        "model_type": mt,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "torch_dtype": cfg.param_dtype,
        "use_sliding_window": False,
        "use_cache": True,
    }


def to_hf_state_dict(cfg: ModelConfig, params, only=None, contiguous: bool = True) -> dict:
    """Our pytree -> {HF tensor name: numpy array} (kernels transposed to [out, in]); dtype kept.
    `only`: a set of HF names to build (the others are skipped, not copied); None = all. `contiguous=False` gives
    kernels as transposed views (no copy; a consumer that copies anyway, like vLLM's loaders, transposes then)."""
    T = (lambda a: np.ascontiguousarray(a.T)) if contiguous else (lambda a: a.T)
    want = (lambda name: True) if only is None else only.__contains__
    out = {}
    if want("model.embed_tokens.weight"):
        out["model.embed_tokens.weight"] = np.asarray(params["embed"])
    if want("model.norm.weight"):
        out["model.norm.weight"] = np.asarray(params["final_norm"])
    if not cfg.tie_embeddings and want("lm_head.weight"):
        out["lm_head.weight"] = T(np.asarray(params["lm_head"]))
    lay = params["layers"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for ours, hf in _PROJ.items():
            if want(pre + hf + ".weight"):
                out[pre + hf + ".weight"] = T(np.asarray(lay[ours]["kernel"][i]))
            if "bias" in lay[ours] and want(pre + hf + ".bias"):
                out[pre + hf + ".bias"] = np.asarray(lay[ours]["bias"][i])
        for ours, hf in HF_NORMS.items():
            if ours in lay and want(pre + hf + ".weight"):
                out[pre + hf + ".weight"] = np.asarray(lay[ours][i])
    return out


HF_TOP = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_names_touched(changed: dict, shapes: dict) -> set:
    """HF tensor names holding the changed words of our leaves. `changed`: {leaf path ('layers/q_proj/kernel'):
    flat positions in the leaf, or None for all}; `shapes`: {leaf path: shape}. A stacked layer leaf [L, ...]
    touches layer i's tensor only where a position falls in block i."""
    out = set()
    for leaf, idx in changed.items():
        if leaf in HF_TOP:
            out.add(HF_TOP[leaf])
            continue
        parts = leaf.split("/")  # layers/<proj>/<kernel|bias> or layers/<norm>
        if parts[0] != "layers" or len(parts) not in (2, 3):
            raise ValueError(f"no Hugging Face name for parameter {leaf!r}")
        shape = shapes[leaf]
        per = int(np.prod(shape[1:], dtype=np.int64))
        layers = range(shape[0]) if idx is None else np.unique(np.asarray(idx, np.int64) // per).tolist()
        if len(parts) == 3:
            hf = _PROJ[parts[1]] + (".weight" if parts[2] == "kernel" else ".bias")
        else:
            hf = HF_NORMS[parts[1]] + ".weight"
        out.update(f"model.layers.{i}.{hf}" for i in layers)
    return out


def from_hf_state_dict(cfg: ModelConfig, tensors: dict, source: str = "checkpoint") -> dict:
    """{HF name: array} -> our pytree (jnp arrays in their stored dtype)."""

    def get(name):
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        return tensors[name]

    L = cfg.num_layers
    layers = {}
    for ours, hf in _PROJ.items():
        layers[ours] = {"kernel": jnp.stack([jnp.asarray(get(f"model.layers.{i}.{hf}.weight")).T for i in range(L)])}
        if ours in ("q_proj", "k_proj", "v_proj") and cfg.qkv_bias:
            layers[ours]["bias"] = jnp.stack([jnp.asarray(get(f"model.layers.{i}.{hf}.bias")) for i in range(L)])
    for ours, hf in HF_NORMS.items():
        if ours in ("q_norm", "k_norm") and not cfg.qk_norm:
            continue
        layers[ours] = jnp.stack([jnp.asarray(get(f"model.layers.{i}.{hf}.weight")) for i in range(L)])
    params = {
        "embed": jnp.asarray(get("model.embed_tokens.weight")),
        "layers": layers,
        "final_norm": jnp.asarray(get("model.norm.weight")),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight")).T
    expect = (cfg.vocab_size, cfg.hidden_size)
    if tuple(params["embed"].shape) != expect:
        raise CheckpointError(
            f"{source}: model.embed_tokens.weight has shape {tuple(params['embed'].shape)}; config.json says {expect}"
        )
    return params


def _read_safetensors(path: str) -> dict:
    from safetensors.flax import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors file found")
    tensors = {}
    for f in files:
        fp = os.path.join(path, f)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{fp}: listed in the index but missing")
        try:
            tensors.update(load_file(fp))
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise CheckpointError(f"{fp}: not a readable safetensors file ({e})") from None
    return tensors


def load_hf(path: str):
    """(ModelConfig, params) from a local Hugging Face checkpoint directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing (a Hugging Face checkpoint needs config.json)")
    try:
        with open(cfg_path) as fh:
            hf = json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    cfg = config_from_hf(hf, cfg_path)
    params = from_hf_state_dict(cfg, _read_safetensors(path), path)
    dt = {jnp.dtype(jnp.bfloat16): "bfloat16"}.get(params["embed"].dtype, "float32")
    cfg = dataclasses.replace(cfg, param_dtype=dt, compute_dtype=dt)
    return cfg, params


def save_hf(cfg: ModelConfig, params, path: str, tokenizer=None, shard_bytes: int = 0, overwrite: bool = False) -> str:
    """Write config.json + safetensors (sharded with an index when `shard_bytes` > 0), built in a temp sibling and
    moved in by outdir.install: a new folder appears whole; into an existing one only the files written here
    replace their namesakes (and an earlier export's leftover shards go), a user's other files stay. A non-empty
    folder twocircuit did not write is refused (CheckpointError) unless `overwrite`."""
    from safetensors.flax import save_file

    from twocircuit_jax import outdir

    if outdir.foreign(path) and not overwrite:  # before any work; install checks again
        raise CheckpointError(f"{path}: not empty and not written by twocircuit; pass --overwrite to write into it")
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
    try:
        tensors = {k: jnp.asarray(v) for k, v in to_hf_state_dict(cfg, params).items()}
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config_to_hf(cfg), fh, indent=2)
        if shard_bytes <= 0:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            shards, cur, size = [], {}, 0
            for k in sorted(tensors):
                if cur and size + tensors[k].nbytes > shard_bytes:
                    shards.append(cur)
                    cur, size = {}, 0
                cur[k] = tensors[k]
                size += tensors[k].nbytes
            shards.append(cur)
            weight_map = {}
            for j, sh in enumerate(shards):
                name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, os.path.join(tmp, name), metadata={"format": "pt"})
                weight_map.update({k: name for k in sh})
            total = sum(int(t.nbytes) for t in tensors.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        if tokenizer is not None:
            tokenizer.save(tmp)
        outdir.install(tmp, path, "hf", overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path

"""The Qwen2-family model: pure forward, KV-cache decoding, Hugging Face interop."""

from twocircuit_jax.model.hf_io import CheckpointError, load_hf, save_hf, to_hf_state_dict
from twocircuit_jax.model.qwen2 import (
    KVCache,
    decode_step,
    default_positions,
    forward,
    forward_with_aux,
    init_cache,
    init_params,
)

__all__ = [
    "CheckpointError",
    "KVCache",
    "decode_step",
    "default_positions",
    "forward",
    "forward_with_aux",
    "init_cache",
    "init_params",
    "load_hf",
    "save_hf",
    "to_hf_state_dict",
]

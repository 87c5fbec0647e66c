"""Tiny random transformers models built locally (no network) for parity tests."""

import numpy as np

from twocircuit_jax.config.sections import ModelConfig

# Our smallest model the vLLM CPU build serves (head_dim >= 32), untied: the sampler and weight-sync tests share it.
TINY_VLLM = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=256,
    tie_embeddings=False,
    eos_token_id=2,
)


def make_hf_model(kind: str, out_dir: str, *, tie: bool = False, seed: int = 0, vocab: int = 97):
    import torch
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=12345.0,
        tie_word_embeddings=tie,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    )
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(out_dir)
    return model


def torch_logits(model, tokens, mask):
    import torch

    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        return (
            model(
                input_ids=torch.tensor(np.asarray(tokens)),
                attention_mask=torch.tensor(np.asarray(mask)),
                position_ids=torch.tensor(pos),
            )
            .logits.float()
            .numpy()
        )

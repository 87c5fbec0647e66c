"""The tiny run config the end-to-end tests share: a random char-level model on chain_sum, seconds per step."""

import copy

_BASE = {
    "tokenizer": "char",
    "mesh": {"data": -1},
    "optim": {"lr": 1e-3},
    "model": {
        "vocab_size": 100,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
    },
    "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 64, "eval_size": 8},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "fast": {"pp_size": 2},
    "train": {
        "steps": 2,
        "prompts_per_step": 4,
        "prompts_per_update": 2,
        "eval_every": 0,
        "eval_size": 8,
        "max_prompt_len": 16,
    },
}


def tiny_config(**sections) -> dict:
    """The base config with each given section's keys updated (a non-dict value replaces the key)."""
    cfg = copy.deepcopy(_BASE)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(name), dict):
            cfg[name] = {**cfg[name], **value}
        else:
            cfg[name] = value
    return cfg


# A 16-wide, 4-block model without eos/pad/bos ids: the fast-circuit invariant and fidelity tests' model.
NARROW_MODEL = {
    "vocab_size": 100,
    "hidden_size": 16,
    "num_layers": 4,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 32,
    "qkv_bias": False,
}

# A 32-wide, 4-block model without eos/pad/bos ids: the fast-circuit wiring, bootstrap and probe tests' model.
FOUR_BLOCK_MODEL = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_layers": 4,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
}


def circuit_state(circuit=None, params=None, step: int = 1, first_minibatch: bool = True):
    """The circuit state of a step's first tick with only the fast circuit's fields (None = the dense trainer's),
    its buffers distinct so a train step may donate it."""
    from twocircuit_jax.step.circuit_state import CircuitState, distinct_buffers, init_clock, set_clock

    cs = CircuitState(init_clock(step), None, None, None, None)
    if circuit is not None:
        cs = cs._replace(codec=circuit.init_codec_state(), grad=circuit.init_grad_state(params))
    return distinct_buffers(set_clock(cs, first_minibatch=first_minibatch))


GRAD_KEYS = ("grad_rank", "start_after", "error_feedback", "compress_embeddings", "min_compression_rate")
FAST_KEYS = ("codec_old_logprob", "codec_reference", "kernel_interpret")  # FastConfig's own, beside pp_size


def fast_section(codec: str = "none", grad_codec: str = "none", pp_size: int | None = None, **knobs) -> dict:
    """A `fast:` section from the tests' keyword form: `fast_section("prf_mask", p=0.5)`, `fast_section(
    grad_codec="powersgd", grad_rank=2, start_after=0)`. PowerSGD's knobs (GRAD_KEYS; `grad_rank` is its `rank`)
    go to `grad_codec`, every other knob to `codec`. Lowrank gets rank 3 and PowerSGD rank 2 unless given."""
    own = {k: knobs.pop(k) for k in FAST_KEYS if k in knobs}
    act = {"type": codec, **{k: v for k, v in knobs.items() if k not in GRAD_KEYS}}
    grad = {"type": grad_codec, **{k: v for k, v in knobs.items() if k in GRAD_KEYS}}
    if "grad_rank" in grad:
        grad["rank"] = grad.pop("grad_rank")
    if codec == "lowrank":
        act.setdefault("rank", 3)
    if grad_codec == "powersgd":
        grad.setdefault("rank", 2)
    out = {"codec": act, "grad_codec": grad, **own}
    return out if pp_size is None else {**out, "pp_size": pp_size}


def narrow_run_config(kl_coef: float = 0.0, anchor=None, num_layers: int = 4, pp_size: int = 4, **fast):
    """The fast-circuit invariant and fidelity tests' run: the narrow model, pp_size 4 (boundaries 0, 1, 2), one
    16-row mini-batch of 12 tokens (6 response). `fast`: the keyword form of `fast_section`."""
    from twocircuit_jax.config import load_config

    return load_config(
        data={
            "model": {**NARROW_MODEL, "num_layers": num_layers},
            "grpo": {"kl_coef": kl_coef},
            "sampler": {"n": 4},
            "fast": fast_section(pp_size=pp_size, **fast),
            "anchor": anchor or {"enabled": False},
            "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 6},
        }
    )


def narrow_batch(n_keys: int = 2):
    """(batch, keys): the narrow run's 16 × 12 mini-batch (the last 6 tokens the response, every row the same
    number of loss tokens) from the keys split(PRNGKey(3), n_keys); k[0] draws the tokens, k[1] the advantages."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    B, T, new = 16, 12, 6
    k = jax.random.split(jax.random.PRNGKey(3), n_keys)
    resp = np.zeros((B, T), np.float32)
    resp[:, T - new :] = 1.0
    batch = {
        "tokens": jax.random.randint(k[0], (B, T), 3, 100, jnp.int32),
        "attention_mask": jnp.ones((B, T), jnp.int32),
        "response_mask": jnp.asarray(resp),
        "advantages": jax.random.normal(k[1], (B,)),
        "sample_id": jnp.arange(B, dtype=jnp.int32),
    }
    return batch, k


def with_device_count(n: int) -> str:
    """This session's XLA_FLAGS with the fake device count set to n, for a child process: the other flags (the
    suite's LLVM optimisation level 0, tests/conftest.py) stay, so the child compiles as fast as the suite."""
    import os
    import re

    rest = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    return " ".join([f"--xla_force_host_platform_device_count={n}", *rest])


def wait_all(procs, timeout: float = 600) -> list:
    """(stdout, stderr) of each of `procs` (subprocess.Popen with pipes), each waited for at most `timeout` s; any
    still running then is killed (a process waiting in a collective its peer never joins would hang the suite), and
    a non-zero exit fails the test with the end of that process's stderr."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{err[-4000:]}"
    return outs

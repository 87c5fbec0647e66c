"""The narrow run (tiny_run.narrow_run_config) at 2 layers for the tests whose property holds at any depth: the
layers unroll (model.scan_layers off), so each one adds its share to every compile, and a 4-layer stack doubled the
compile time of tests that split rows (micro-batch accumulation) or compare a step with its reference step."""

from tiny_run import NARROW_MODEL


def narrow2_run_config(kl_coef: float = 0.0, **fast):
    """narrow_run_config's run with num_layers 2 and pp_size 2: one codec boundary, after layer 0."""
    from twocircuit_jax.config import load_config

    fast = dict(fast)
    if fast.get("codec") == "lowrank":
        fast.setdefault("rank", 3)
    if fast.get("grad_codec") == "powersgd":
        fast.setdefault("grad_rank", 2)
    return load_config(
        data={
            "model": {**NARROW_MODEL, "num_layers": 2},
            "grpo": {"kl_coef": kl_coef},
            "sampler": {"n": 4},
            "fast": {"pp_size": 2, **fast},
            "anchor": {"enabled": False},
            "train": {"train_batch": 4, "mini_batch": 4, "max_prompt_len": 6},
        }
    )

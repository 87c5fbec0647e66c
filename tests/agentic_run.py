"""The agentic end-to-end tests' shared run: the number-guessing game (1..15, noisy verdicts, 4 turns) on a small
char model that a short SFT on the noisy expert teaches to play legal moves. head_dim 32: vLLM's CPU attention."""

from tiny_run import tiny_config

GUESS = {
    "type": "guess",
    "low": 1,
    "high": 15,
    "noise": 0.2,
    "max_turns": 4,
    "train_size": 256,
    "eval_size": 8,
    "expert_noise": 0.3,
}


def agentic_config(base: str = "", **sections) -> dict:
    d = tiny_config(
        name="agentic_tiny",
        model={"hidden_size": 64, "head_dim": 32, "intermediate_size": 96, "max_position_embeddings": 64},
        env=GUESS,
        sampler={"n": 4, "sampling": {"max_new_tokens": 3}},
        train={
            "steps": 4,
            "prompts_per_step": 4,
            "prompts_per_update": 2,
            "eval_every": 2,
            "eval_size": 8,
            "max_prompt_len": 24,
        },
        sft={"steps": 150, "batch": 64, "lr": 3e-3, "warmup_steps": 10, "max_len": 27, "eval_every": 150},
    )
    for name, value in sections.items():
        d[name] = {**d.get(name, {}), **value} if isinstance(value, dict) else value
    if base:
        d["base_model"] = base
    return d


def build_base(out: str) -> str:
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.sft import run_sft

    run_sft(load_config(data=agentic_config()), out, log=lambda *a: None)
    return out

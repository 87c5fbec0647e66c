"""A small SFT'd base on 1-digit chain_sum (held-out accuracy ~0.25), shared by the tests that need a policy with
something to lose or to win: the collapse guard's runs (test_guard.py) and the benchmark suite's trained checkpoint
(test_eval_suite.py). Built once per pytest process by conftest's session fixture `chain_sum_base` (~20 s of CPU:
300 SFT steps), read-only for its users; tests/conftest.py puts both files in one xdist group."""

from tiny_run import tiny_config

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
MODEL = {"hidden_size": 64, "head_dim": 32, "intermediate_size": 128}
TASK = {"dataset": "chain_sum", "options": CHAIN, "train_size": 1000}  # train_seed 1 (the default)
SFT = {"steps": 300, "batch": 64, "lr": 3e-3, "warmup_steps": 10, "max_len": 16, "eval_every": 300}


def base_config() -> dict:
    """The SFT run of the base; its final held-out accuracy is read on chain_sum's default held-out split (64)."""
    return tiny_config(
        model=MODEL,
        task={**TASK, "eval_size": 64},
        sampler={"n": 8, "sampling": {"max_new_tokens": 6}},  # as the guard's runs
        train={"eval_size": 64},
        sft=SFT,
    )


def build(out: str) -> dict:
    """SFT the base into `out` (an HF folder); returns run_sft's result (its `eval/accuracy`)."""
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.sft import run_sft

    return run_sft(load_config(data=base_config()), out, log=lambda *a: None)

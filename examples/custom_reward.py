"""GRPO with your own reward functions on your own rows: `python examples/custom_reward.py [STEPS] [OUT]`."""

import sys

import twocircuit_jax as tc

# Any iterable of dicts (a datasets.Dataset too): a prompt, and the fields the rewards read.
rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def correct(prompts, completions, answer, **fields):  # one float per completion
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def brief(prompts, completions, **fields):
    return [-len(c) / 4 for c in completions]


config = {  # a tiny random model and the built-in character tokenizer: nothing to download
    "model": {"vocab_size": 100, "hidden_size": 32, "num_layers": 2, "head_dim": 16, "intermediate_size": 64},
    "optim": {"lr": 1e-3},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
    "train": {"steps": int(sys.argv[1]) if len(sys.argv) > 1 else 20, "eval_every": 0, "max_prompt_len": 8},
}
out = sys.argv[2] if len(sys.argv) > 2 else "runs/custom_reward"
trainer = tc.GRPOTrainer(
    config, out, reward_fns=[correct, brief], reward_weights=[1.0, 0.1], train_dataset=rows, eval_dataset=rows[:16]
)
print(trainer.run())  # or: trainer.step() at a time; metrics.jsonl has reward/correct and reward/brief

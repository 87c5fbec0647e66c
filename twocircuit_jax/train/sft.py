"""Supervised fine-tuning of a base model on task solutions (`twocircuit sft`).

The embedded default is a tiny character-level Qwen2-shaped model trained from scratch until its held-out accuracy
is middling: RL needs both successes and failures inside each group to learn from. The result is written as a
Hugging Face directory (weights + the char tokenizer), which the GRPO config's `base_model` and vLLM both load.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import optax

from twocircuit_jax.config.run import load_config
from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.envs.expert import expert_examples
from twocircuit_jax.model.hf_io import save_hf
from twocircuit_jax.parallel import mesh as pmesh
from twocircuit_jax.sampler.jax_sampler import JaxSampler
from twocircuit_jax.step.circuit_state import place
from twocircuit_jax.step.programs import build_sft_step
from twocircuit_jax.step.train_step import init_state, state_shardings
from twocircuit_jax.train.collect import make_collector
from twocircuit_jax.train.rollout import encode_prompts
from twocircuit_jax.train.setup import check_vocab, load_model, load_run_tokenizer


def sft_examples(task, tokenizer, problems, max_len: int):
    """tokens [N, max_len] (right-padded), attention_mask, loss_mask (1 on the solution and EOS)."""
    prompts = encode_prompts(tokenizer, task, problems, max_len, field="sft.max_len")
    N = len(problems)
    tok = np.full((N, max_len), tokenizer.pad_id, np.int32)
    attn = np.zeros((N, max_len), np.int32)
    lm = np.zeros((N, max_len), np.int32)
    for i, (p, prob) in enumerate(zip(prompts, problems)):
        sol = tokenizer.encode(task.reference_completion(prob)) + [tokenizer.eos_id]
        seq = (p + sol)[:max_len]
        tok[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        lm[i, len(p) : len(seq)] = 1
    return {"tokens": tok, "attention_mask": attn, "loss_mask": lm}


def run_sft(cfg, out_dir: str, log=print, overwrite: bool = False) -> dict:
    """Train, then write the model to `out_dir` (model/hf_io.py save_hf: someone else's non-empty folder is refused
    before any training unless `overwrite`, and even then only the files written here are replaced)."""
    from twocircuit_jax.outdir import check_out

    check_out(out_dir, overwrite)
    s = cfg.sft
    tokenizer = load_run_tokenizer(cfg)
    model_cfg, params = load_model(cfg, cfg.train.seed)
    model_cfg = check_vocab(model_cfg, tokenizer)
    max_new = cfg.sampler.sampling.max_new_tokens
    collector, task = make_collector(cfg, tokenizer, SamplingConfig(max_new_tokens=max_new))
    if cfg.env.enabled:  # an environment: its expert's interactions, prompted as training prompts are
        data = expert_examples(task, cfg.env, tokenizer, cfg.train.max_prompt_len, s.max_len, cfg.train.seed)
    else:
        data = sft_examples(task, tokenizer, task.train_problems(), s.max_len)
    mesh = pmesh.make_mesh(cfg.mesh)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, s.lr, s.warmup_steps, max(s.steps, s.warmup_steps + 1), end_value=s.lr * 0.1
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    state = init_state(params, opt)
    sh = state_shardings(state, mesh)
    state = jax.device_put(state, sh)
    batch_sh = {k: pmesh.batch_sharding(mesh) for k in data}
    circuits, jitted = build_sft_step(model_cfg, opt, sh, mesh, batch_sh)  # step/programs.py: no circuit
    cs = place(circuits.cs, circuits.cs_sh)
    rng = np.random.default_rng(cfg.train.seed)
    evaluator = collector.evaluator(task.eval_problems()[: cfg.train.eval_size], greedy=True)
    log(f"sft: {len(data['tokens'])} examples")
    history, t0 = [], time.perf_counter()
    N = len(data["tokens"])
    for i in range(1, s.steps + 1):
        idx = rng.integers(0, N, s.batch)
        state, cs, m = jitted(state, cs, {k: v[idx] for k, v in data.items()})
        if (s.eval_every and i % s.eval_every == 0) or i == s.steps:  # 0: only after the last step
            acc = evaluator.run(JaxSampler(model_cfg, state.params, prompt_bucket=cfg.train.max_prompt_len))
            rec = {
                "step": i,
                "loss": float(m["loss"]),
                "token_acc": float(m["sft/token_acc"]),
                "eval/accuracy": acc["eval/accuracy"],
                "time_s": round(time.perf_counter() - t0, 1),
            }
            history.append(rec)
            log(
                f"sft step {i}/{s.steps}  loss {rec['loss']:.3f}  token acc {rec['token_acc']:.3f}  "
                f"held-out acc {rec['eval/accuracy']:.3f}  ({rec['time_s']}s)"
            )
    save_hf(model_cfg, jax.device_get(state.params), out_dir, tokenizer=tokenizer, overwrite=overwrite)
    return {"out": out_dir, "history": history, "eval/accuracy": history[-1]["eval/accuracy"] if history else None}


def base_once(config_path: str, out_dir: str, what: str, log=print) -> None:
    """Build the base model `config_path` describes into `out_dir` by SFT, unless a model is already there (the
    demos reuse theirs)."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        log(f"reusing the base at {out_dir}")
        return
    log(f"building {what} by SFT -> {out_dir}")
    run_sft(load_config(config_path), out_dir, log=log)

"""Playing trajectories: every active trajectory's next turn is sampled in one call to the rollout engine.

Turn t of a trajectory is prompted with its conversation so far (the opening observation, then each action and
the observation it got), encoded afresh and left-truncated to `prompt_len` tokens (BOS kept), which is counted.
The response is the sampled tokens themselves, with the sampler's log-probs: what trains is what was sampled.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple, Optional, Sequence

import numpy as np

from twocircuit_jax.envs.base import StepResult
from twocircuit_jax.tasks.base import Problem
from twocircuit_jax.tasks.bounded import ERROR, TIMEOUT, worker_for


class Turn(NamedTuple):
    traj: int  # trajectory index: problem-major, problem i's n trajectories are i*n .. i*n+n-1
    turn: int  # 0-based interaction index
    prompt: list  # list[int]: the conversation so far, left-truncated
    tokens: list  # list[int]: the sampled action, EOS included when emitted
    logprobs: list  # list[float]: sampler log-prob per sampled token
    truncated: bool  # the action hit max_new_tokens without EOS
    prompt_cut: bool  # the conversation was longer than prompt_len and lost its head
    reward: float  # what the environment gave this action (the format penalty for a malformed one)
    format_ok: bool


class Episodes(NamedTuple):
    turns: list  # list[Turn], trajectory-major then turn
    rewards: list  # list[list[float]]: per trajectory, per turn
    success: list  # list[bool] per trajectory
    conversations: list  # list[str]: each trajectory's full text
    timed_out: list  # list[bool]: used every turn without the environment ending it
    weight_version: int  # the oldest weight version any turn was sampled with
    gen_s: float  # seconds inside the rollout engine
    step_timeouts: Optional[int] = (
        None  # steps stopped at env.step_timeout_s (reward 0, trajectory ended); None: no bound
    )
    reset_timeouts: Optional[int] = None  # resets stopped at env.step_timeout_s (no turn, failed); None: no bound


def encode_conversation(tokenizer, text: str, prompt_len: int) -> tuple[list[int], bool]:
    ids = tokenizer.encode(text)
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None and tokenizer.is_char else []
    cut = len(head) + len(ids) > prompt_len
    if cut:
        ids = ids[len(ids) - (prompt_len - len(head)) :]
    return head + ids, cut


def _bucket(k: int, most: int) -> int:
    """Rows sent to an engine that compiles per batch shape: the next power of two (at most `most`)."""
    return min(most, 1 << max(0, k - 1).bit_length())


def run_episodes(
    family,
    problems: Sequence[Problem],
    n: int,
    sampler,
    tokenizer,
    sampling,
    *,
    max_turns: int,
    prompt_len: int,
    format_penalty: float,
    rng: np.random.Generator,
    seed_of_turn,
) -> Episodes:
    """n trajectories per problem, at most `max_turns` interactions each. `rng` is the environment RNG (advanced
    here: one child generator per trajectory); `seed_of_turn(t)` the sampler seed of turn t."""
    B = len(problems) * n
    envs = [family.make(np.random.default_rng(int(rng.integers(2**63)))) for _ in range(B)]
    limit, timeouts = float(getattr(family.cfg, "step_timeout_s", 0.0)), 0
    opened = call_envs(family, envs, range(B), "reset", [problems[i // n] for i in range(B)], limit)
    # A reset stopped at the bound: that trajectory is over before its first turn (no row, return 0, not a success).
    done = [obs is None for obs in opened]
    conv = ["" if obs is None else obs for obs in opened]
    reset_timeouts = sum(done)
    if reset_timeouts:
        print(
            f"warning: {reset_timeouts} environment reset(s) took longer than env.step_timeout_s={limit:g} and were "
            "stopped; those trajectories failed without a turn",
            file=sys.stderr,
        )
    rewards: list[list[float]] = [[] for _ in range(B)]
    success = [False] * B
    turns, version, gen_s = [], None, 0.0
    pads = getattr(sampler, "pads_batch", False)
    for t in range(max_turns):
        active = [i for i in range(B) if not done[i]]
        if not active:
            break
        enc = [encode_conversation(tokenizer, conv[i], prompt_len) for i in active]
        prompts = [e[0] for e in enc]
        if pads:  # fixed shapes: a few batch sizes compile, not one per count of live trajectories
            prompts = prompts + [prompts[0]] * (_bucket(len(prompts), B) - len(prompts))
        t0 = time.perf_counter()
        if getattr(sampler, "accepts_keys", False):  # a fleet: each trajectory stays on its engine (prefix cache)
            keys = active + [active[0]] * (len(prompts) - len(active))
            out = sampler.generate(prompts, 1, sampling, seed=seed_of_turn(t), keys=keys)
        else:
            out = sampler.generate(prompts, 1, sampling, seed=seed_of_turn(t))
        gen_s += time.perf_counter() - t0
        version = out.weight_version if version is None else min(version, out.weight_version)
        texts = [tokenizer.decode(list(out.tokens[j])) for j in range(len(active))]
        results = call_envs(family, envs, active, "step", texts, limit)
        for j, i in enumerate(active):
            toks = list(out.tokens[j])
            text, res = texts[j], results[j]
            if res is None:  # stopped at env.step_timeout_s: reward 0, the trajectory ends here
                timeouts += 1
                res = StepResult("", 0.0, True, {"format_ok": True, "success": False, "timed_out": True})
            ok = bool(res.info.get("format_ok", True))
            r = float(res.reward) if ok else format_penalty
            turns.append(Turn(i, t, enc[j][0], toks, list(out.logprobs[j]), bool(out.truncated[j]), enc[j][1], r, ok))
            rewards[i].append(r)
            conv[i] += text + res.observation
            if res.done or not ok:
                done[i] = True
                success[i] = bool(res.info.get("success", False))
    turns.sort(key=lambda x: (x.traj, x.turn))
    if timeouts:
        print(
            f"warning: {timeouts} environment step(s) took longer than env.step_timeout_s={limit:g} and were "
            "stopped; those actions got reward 0 and ended their trajectories",
            file=sys.stderr,
        )
    v = 0 if version is None else version
    timed_out = [not d for d in done]
    bounded = limit > 0
    return Episodes(
        turns,
        rewards,
        success,
        conv,
        timed_out,
        v,
        gen_s,
        timeouts if bounded else None,
        reset_timeouts if bounded else None,
    )


def _env_call(family, call):
    """In the worker: (the method's result, the environment after it), so its state comes back to the trainer."""
    env, method, arg = call
    return getattr(env, method)(arg), env


def call_envs(family, envs, active, method: str, args, timeout_s: float) -> list:
    """envs[i].<method>(args[j]) (`reset` or `step`) for each active trajectory i (j its position): the result, or
    None when the call was stopped at `timeout_s`. With `timeout_s` > 0 the calls run in the family's worker
    (tasks/bounded.py, forked once per family): each environment travels there and back with its call, so its state
    advances as if called here, and one that was stopped keeps its state from before. An environment's exception
    is raised here, as without a bound."""
    active = list(active)
    if timeout_s <= 0:
        return [getattr(envs[i], method)(a) for i, a in zip(active, args)]
    calls = [(envs[i], method, a) for i, a in zip(active, args)]
    out = []
    for k, (kind, value) in enumerate(worker_for(family, "env", _env_call).map(calls, timeout_s)):
        if kind == TIMEOUT:
            out.append(None)
        elif kind == ERROR:
            raise value
        else:
            res, envs[active[k]] = value
            out.append(res)
    return out


def episode_metrics(ep: Episodes, prefix: str = "env/") -> dict:
    """`env/return` (mean trajectory return), `env/turns_mean`, `env/success`, `env/format_penalty_frac` (share of
    actions the environment could not read), `env/prompt_truncated_frac`, `env/timeout_frac` (trajectories that
    used every turn without finishing), `env/step_timeouts` and `env/reset_timeouts` (with env.step_timeout_s set)."""
    n_turns = [len(r) for r in ep.rewards]
    out = {
        f"{prefix}return": float(np.mean([sum(r) for r in ep.rewards])),
        f"{prefix}turns_mean": float(np.mean(n_turns)),
        f"{prefix}success": float(np.mean(ep.success)),
        f"{prefix}format_penalty_frac": float(np.mean([not x.format_ok for x in ep.turns])) if ep.turns else 0.0,
        f"{prefix}prompt_truncated_frac": float(np.mean([x.prompt_cut for x in ep.turns])) if ep.turns else 0.0,
        f"{prefix}timeout_frac": float(np.mean(ep.timed_out)),
    }
    if ep.step_timeouts is not None:  # with env.step_timeout_s set: steps stopped at the bound
        out[f"{prefix}step_timeouts"] = float(ep.step_timeouts)
    if ep.reset_timeouts is not None:  # and resets stopped at it (failed trajectories without a turn)
        out[f"{prefix}reset_timeouts"] = float(ep.reset_timeouts)
    return out

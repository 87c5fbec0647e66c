"""Multi-turn environments: the built-in games, trajectories into rows (prompts nest, one row per interaction),
returns and group advantages, the format floor, left truncation, and the env section's validation."""

import numpy as np
import pytest

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.env import CalculatorEnv, GuessEnv
from twocircuit_jax.config.sections import GRPOConfig, SamplingConfig
from twocircuit_jax.envs import make_env
from twocircuit_jax.envs.calculator import evaluate
from twocircuit_jax.envs.episodes import encode_conversation, episode_metrics, run_episodes
from twocircuit_jax.envs.rows import pack_episodes, rewards_to_returns, row_advantages
from twocircuit_jax.model.tokenizer import load_tokenizer
from twocircuit_jax.sampler.base import Rollout
from twocircuit_jax.tasks.base import Problem

TOK = load_tokenizer("char")


class ScriptedSampler:
    """A rollout engine whose policy is a function of the prompt text: the game logic under test is the
    environment's and the runner's, not a model's. Records every call's prompts."""

    def __init__(self, policy, max_new=8):
        self.policy, self.max_new, self.calls = policy, max_new, []

    def generate(self, prompts, n, sampling, seed):
        texts = [self.policy(TOK.decode([t for t in p if t != TOK.bos_id])) for p in prompts for _ in range(n)]
        self.calls.append(prompts)
        toks = [TOK.encode(t)[: self.max_new] + ([TOK.eos_id] if len(t) < self.max_new else []) for t in texts]
        return Rollout(toks, [[-0.5] * len(t) for t in toks], [len(t) >= self.max_new for t in texts], 3)


def _guess(target, **kw):
    cfg = GuessEnv(**{"low": 1, "high": 31, "train_size": 4, "eval_size": 2, **kw})
    fam = make_env(cfg)
    return cfg, fam, Problem("guess/t/0", "1-31?", str(target), str(target), {})


def _play(fam, cfg, problems, policy, n=1, prompt_len=32, seed=0):
    sampler = ScriptedSampler(policy)
    ep = run_episodes(
        fam,
        problems,
        n,
        sampler,
        TOK,
        SamplingConfig(max_new_tokens=8),
        max_turns=cfg.max_turns,
        prompt_len=prompt_len,
        format_penalty=cfg.format_penalty,
        rng=np.random.default_rng(seed),
        seed_of_turn=lambda k: k,
    )
    return ep, sampler


def test_a_three_turn_trajectory_gives_three_rows_whose_prompts_nest():
    cfg, fam, prob = _guess(20, max_turns=5)
    script = {"1-31?": "16", "1-31?16>": "24", "1-31?16>24<": "20"}
    ep, _ = _play(fam, cfg, [prob], lambda text: script[text])
    assert [(x.traj, x.turn) for x in ep.turns] == [(0, 0), (0, 1), (0, 2)]
    assert ep.rewards == [[0.0, 0.0, 1.0]] and ep.success == [True] and ep.timed_out == [False]
    assert ep.conversations == ["1-31?16>24<20="]
    prompts = [x.prompt for x in ep.turns]
    for a, b in zip(prompts, prompts[1:]):
        assert len(b) > len(a) and b[: len(a)] == a  # each turn's prompt extends the one before
    assert [TOK.decode(x.tokens) for x in ep.turns] == ["16", "24", "20"]
    batch, row_turn = pack_episodes(ep, 1, cfg.max_turns, 32, 8, TOK.pad_id, cfg, GRPOConfig())
    assert batch["tokens"].shape == (5, 40) and list(row_turn) == [0, 1, 2, -1, -1]
    for k, x in enumerate(ep.turns):  # the row holds [left-padded prompt | action]
        row = batch["tokens"][k]
        assert list(row[32 - len(x.prompt) : 32]) == x.prompt and list(row[32 : 32 + len(x.tokens)]) == x.tokens
        assert batch["response_mask"][k].sum() == len(x.tokens) and batch["loss_mask"][k] == 1.0
    assert batch["attention_mask"][3:].sum() == 0 and batch["loss_mask"][3:].sum() == 0  # unused turns: empty


def test_the_runner_batches_only_live_trajectories():
    cfg, fam, prob = _guess(20, max_turns=5)
    # the hidden numbers are 20 and 22: the first game ends at turn 0, the second goes on alone
    script = {"1-31?": "20", "1-31?20>": "21", "1-31?20>21>": "22"}
    ep, sampler = _play(fam, cfg, [prob, prob._replace(answer="22")], lambda t: script[t])
    assert [len(c) for c in sampler.calls] == [2, 1, 1]
    assert ep.success == [True, True] and [len(r) for r in ep.rewards] == [1, 3]


def test_returns_discount_and_group_advantages():
    assert rewards_to_returns([0.0, 0.0, 1.0], "final", 1.0) == [1.0, 1.0, 1.0]
    assert rewards_to_returns([0.0, 0.5, 1.0], "discounted", 0.5) == pytest.approx([0.5, 1.0, 1.0])
    cfg, fam, prob = _guess(20, max_turns=3)
    # two trajectories of one problem: one solves in two moves, one never does
    calls = iter(["16", "16", "20", "1", "2"])  # turn 0: both say 16; turn 1: 20 (solves) and 1; turn 2: 2
    ep, _ = _play(fam, cfg, [prob], lambda t: next(calls), n=2)
    assert ep.success == [True, False] and [len(r) for r in ep.rewards] == [2, 3]
    adv = row_advantages(ep, 2, cfg, GRPOConfig(std_normalize=True, adv_std="population"))
    assert adv[0] == pytest.approx([1.0, 1.0], abs=1e-5) and adv[1] == pytest.approx([-1.0] * 3, abs=1e-5)
    m = episode_metrics(ep)
    assert m["env/return"] == 0.5 and m["env/success"] == 0.5 and m["env/turns_mean"] == 2.5
    assert m["env/timeout_frac"] == 0.5  # the second used every turn without the game ending


def test_the_format_floor_ends_the_trajectory_and_gives_no_gradient():
    cfg, fam, prob = _guess(20, max_turns=4, format_penalty=-1.0)
    ep, _ = _play(fam, cfg, [prob], lambda t: "sixteen", n=4)
    assert ep.rewards == [[-1.0]] * 4 and not any(ep.success)
    assert episode_metrics(ep)["env/format_penalty_frac"] == 1.0
    batch, _ = pack_episodes(ep, 4, cfg.max_turns, 32, 8, TOK.pad_id, cfg, GRPOConfig())
    assert np.all(batch["advantages"] == 0.0)  # the whole group sits at the floor: zero advantage
    # one readable action in the group lifts it off the floor: that trajectory gets the positive advantage
    answers = iter(["20", "x", "x", "x"])
    ep, _ = _play(fam, cfg, [prob], lambda t: next(answers), n=4)
    adv = row_advantages(ep, 4, cfg, GRPOConfig())
    assert adv[0][0] > 0 and all(a[0] < 0 for a in adv[1:])
    assert episode_metrics(ep)["env/format_penalty_frac"] == 0.75


def test_long_conversations_are_left_truncated_keeping_bos_and_counted():
    ids, cut = encode_conversation(TOK, "1-31?16>24<20", 8)
    assert cut and len(ids) == 8 and ids[0] == TOK.bos_id and TOK.decode(ids[1:]) == "6>24<20"
    ids, cut = encode_conversation(TOK, "1-31?", 8)
    assert not cut and TOK.decode(ids[1:]) == "1-31?"
    cfg, fam, prob = _guess(20, max_turns=6)
    seq = iter(["1", "2", "3", "4", "20"])
    ep, _ = _play(fam, cfg, [prob], lambda t: next(seq), prompt_len=9)
    assert [x.prompt_cut for x in ep.turns] == [False, False, True, True, True]
    assert all(len(x.prompt) <= 9 for x in ep.turns)
    assert episode_metrics(ep)["env/prompt_truncated_frac"] == 0.6


def test_noisy_verdicts_come_from_the_env_rng():
    cfg, fam, prob = _guess(20, max_turns=8, noise=0.4)
    moves = ["1"] * 8
    runs = []
    for seed in (0, 0, 1):
        it = iter(moves)
        ep, _ = _play(fam, cfg, [prob], lambda t: next(it), seed=seed)
        runs.append(ep.conversations[0])
    assert runs[0] == runs[1] and runs[0] != runs[2] and "<" in runs[0]  # a lie: 20 is not lower than 1


def test_calculator_tool_call_then_answer():
    assert evaluate("3*14+5") == 47 and evaluate("2*(3+4)") == 14 and evaluate("2**9") is None
    assert evaluate("__import__('os')") is None and evaluate("3+") is None
    cfg = CalculatorEnv(train_size=8, eval_size=4)
    fam = make_env(cfg)
    p = fam.train_problems()[0]
    assert evaluate(p.question.rstrip("?")) == int(p.answer)
    env = fam.make(np.random.default_rng(0))
    assert env.reset(p) == p.question
    r = env.step("c:" + p.question.rstrip("?"))
    assert r.observation == f"={p.answer};" and not r.done and r.info["format_ok"]
    r = env.step(f"a:{p.answer}")
    assert r.done and r.reward == 1.0 and r.info["success"]
    env.reset(p)
    assert env.step(f"a:{int(p.answer) + 1}").reward == 0.0
    env.reset(p)
    assert not env.step("what is it").info["format_ok"]
    assert not set(p.question for p in fam.eval_problems()) & set(p.question for p in fam.train_problems())


def test_env_section_validates():
    with pytest.raises(ConfigError, match="max_turns"):
        load_config(data={"fast": {"pp_size": 2}, "env": {"type": "guess", "max_turns": 51}})
    with pytest.raises(ConfigError, match="env"):
        load_config(data={"fast": {"pp_size": 2}, "env": {"type": "chess"}})
    cfg = load_config(data={"fast": {"pp_size": 2}, "env": {"type": "calculator", "max_turns": 3}})
    assert cfg.env.enabled and not load_config(data={"fast": {"pp_size": 2}}).env.enabled

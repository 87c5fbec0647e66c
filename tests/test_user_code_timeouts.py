"""`task.reward_timeout_s` and `env.step_timeout_s` bound user code: a reward function or an environment step that
never returns is stopped (its worker process killed) and counts as a failure, as a raise does; the run goes on.
Before, such a call stalled the run forever."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_envs import TOK, ScriptedSampler
from tiny_run import tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.env import GuessEnv
from twocircuit_jax.config.sections import GRPOConfig, PythonTask as PyCfg, SamplingConfig
from twocircuit_jax.envs import make_env
from twocircuit_jax.envs.episodes import episode_metrics, run_episodes
from twocircuit_jax.envs.guess import GuessGame
from twocircuit_jax.envs.rows import row_advantages
from twocircuit_jax.tasks.base import Problem, ScoreResult
from twocircuit_jax.tasks.bounded import ERROR, OK, TIMEOUT, CallTimeout, Worker, close_all, worker_for
from twocircuit_jax.tasks.python_task import PythonTask, reward_fns
from twocircuit_jax.tasks.rewards import score_batch

FOREVER = 10**6


def _hang_on(x, bad):
    if x == bad:
        time.sleep(FOREVER)
    if x == "raise":
        raise KeyError(x)
    return x * 2


def _call(fn, x):
    return fn(x)


def test_a_mapping_worker_stops_a_hung_call_and_goes_on_from_a_thread():
    """From a background thread (where async rollouts collect) as well as the main one: a hung call is stopped
    after the bound and the next calls run in a fresh worker."""
    got, fn = {}, lambda x: _hang_on(x, "b")
    t0 = time.perf_counter()
    th = threading.Thread(target=lambda: got.update(r=worker_for(fn, "map", _call).map(["a", "b", "raise", "c"], 1.0)))
    th.start()
    th.join(60)
    assert not th.is_alive() and time.perf_counter() - t0 < 30
    kinds = [k for k, _ in got["r"]]
    assert kinds == [OK, TIMEOUT, ERROR, OK] and got["r"][0][1] == "aa" and got["r"][3][1] == "cc"
    assert isinstance(got["r"][2][1], KeyError)


class _Task:
    """A per-row scorer (tasks/base.py interface) that hangs on one completion."""

    cfg = SimpleNamespace(reward_timeout_s=1.0)

    def score(self, problem, text):
        if text == "hang":
            time.sleep(FOREVER)
        return ScoreResult(float(text == problem.answer), True)


class _StepTask:
    """A scorer whose reward is the step its `begin_step` hook was last given (a curriculum's shape)."""

    cfg = SimpleNamespace(reward_timeout_s=30.0)

    def __init__(self):
        self.step = 0

    def begin_step(self, gs):
        self.step = gs

    def score(self, problem, text):
        return ScoreResult(float(self.step), True)


def test_the_scoring_worker_sees_the_step_its_task_began():
    """The worker is a fork: after `begin_step`, the trainer refreshes it (train/loop.py), or it would score with the
    state the task had at its first call (the collapse task of tests/test_guard.py would never turn)."""
    from twocircuit_jax.tasks.bounded import refresh

    task, probs = _StepTask(), [Problem("p0", "q", "4", "4", {})]
    step = lambda: score_batch(task, probs, ["4"], [1], [False], 8, GRPOConfig())[0][0]  # noqa: E731
    assert step() == 0.0
    task.begin_step(3)
    assert step() == 0.0  # the worker forked at step 0 still scores there: what refresh is for
    refresh(task)
    assert step() == 3.0
    task.begin_step(5)
    refresh(task)
    assert step() == 5.0


def test_a_hung_scorer_gives_the_failure_reward_and_is_counted():
    probs = [Problem(f"p{i}", "q", "4", "4", {}) for i in range(4)]
    texts = ["4", "hang", "5", "4"]
    t0 = time.perf_counter()
    rewards, mask, _, m = score_batch(_Task(), probs, texts, [1] * 4, [False] * 4, 8, GRPOConfig())
    assert time.perf_counter() - t0 < 30
    assert list(rewards) == [1.0, 0.0, 0.0, 1.0] and list(mask) == [1.0] * 4
    assert m["reward/score_errors"] == 1 and m["reward/timeouts"] == 1
    assert (
        "TimeoutError" in m["reward/first_score_error"] and "task.reward_timeout_s=1" in m["reward/first_score_error"]
    )


def starts_right(prompts, completions, answer, **_):
    if any(c == "hang" for c in completions):
        time.sleep(FOREVER)
    return [float(c.startswith(a)) for c, a in zip(completions, answer)]


def test_a_hung_python_reward_function_costs_one_bound_per_call():
    """The batched call hangs: every row of it gets 0 from the function, each counted, and the step goes on after
    one bound. No row-by-row retry as after a raise: with the bound on by default, a function that always hangs
    would cost (rows + 1) bounds per step that way (257 x 300 s on the demo's shapes)."""
    rows = [{"prompt": f"q{i}", "answer": "7"} for i in range(4)]
    task = PythonTask(PyCfg(reward_timeout_s=1.0, max_reward_failure_frac=1.0), reward_fns([starts_right]), rows)
    res, m = task.score_many(task.train_problems(), ["7", "hang", "8", "77"])
    assert [r.reward for r in res] == [0.0, 0.0, 0.0, 0.0] and m["reward/fn_errors"] == 4


class HangingGame(GuessGame):
    """The guessing game with a bug: the action "13" never returns."""

    def step(self, action_text):
        if action_text == "13":
            time.sleep(FOREVER)
        return super().step(action_text)


def _episodes(timeout, problems, policy, game=None):
    fam = make_env(GuessEnv(low=1, high=31, train_size=4, eval_size=2, max_turns=4, step_timeout_s=timeout))
    fam.make = lambda rng: (game or HangingGame)(1, 31, 0.0, rng)
    return run_episodes(
        fam,
        problems,
        1,
        ScriptedSampler(policy),
        TOK,
        SamplingConfig(max_new_tokens=8),
        max_turns=4,
        prompt_len=32,
        format_penalty=-1.0,
        rng=np.random.default_rng(0),
        seed_of_turn=lambda k: k,
    )


def test_a_hung_environment_step_ends_its_trajectory_with_reward_0(capsys):
    script = {"A?": "16", "A?16>": "24", "A?16>24<": "20", "B?": "13"}
    a, b = Problem("a", "A?", "20", "20", {}), Problem("b", "B?", "5", "5", {})
    t0 = time.perf_counter()
    ep = _episodes(1.0, [a, b], lambda text: script[text])
    assert time.perf_counter() - t0 < 30
    ref = _episodes(0, [a], lambda text: script[text])  # trajectory A alone, stepped in this process
    assert ep.rewards == [ref.rewards[0], [0.0]] and ep.rewards[0] == [0.0, 0.0, 1.0]  # state advanced in the worker
    assert ep.success == [True, False] and ep.conversations[0] == ref.conversations[0]
    assert ep.step_timeouts == 1 and episode_metrics(ep)["env/step_timeouts"] == 1.0
    assert "env/step_timeouts" not in episode_metrics(ref)  # no bound: not logged
    assert "env.step_timeout_s=1" in capsys.readouterr().err


def test_the_bounds_validate():
    for key in ("task.reward_timeout_s", "env.step_timeout_s"):
        data = tiny_config(env={"type": "guess"}) if key.startswith("env") else tiny_config()
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(data=data, overrides=[f"{key}=-1"])


HANG_ROWS = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(8)]


def hang_always(prompts, completions, **_):
    time.sleep(FOREVER)


@pytest.mark.slow
def test_a_training_step_completes_with_a_reward_function_that_never_returns(tmp_path, capsys):
    from twocircuit_jax.train.loop import GRPOTrainer

    data = tiny_config(
        task={"type": "python", "reward_timeout_s": 0.5, "max_reward_failure_frac": 1.0},
        eval={"at_start": False, "at_end": False},
        train={"steps": 1, "prompts_per_step": 2, "eval_every": 0},
    )
    data["task"] = {"type": "python", "reward_timeout_s": 0.5, "max_reward_failure_frac": 1.0}
    run = str(tmp_path / "run")
    tr = GRPOTrainer(
        load_config(data=data), run, reward_fns=[hang_always], train_dataset=HANG_ROWS, show_progress=False
    )
    t0 = time.perf_counter()
    with tr:
        m = tr.step()
    rows = 2 * 4
    assert time.perf_counter() - t0 < 120
    assert m["reward/fn_errors"] == rows and m["reward/score_errors"] == rows and m["reward/mean"] == 0.0
    assert "reward/timeouts" not in m  # a batch scorer's stopped calls are its fn_errors
    assert os.path.isfile(os.path.join(run, "metrics.jsonl"))


# --- the long-lived worker (forked once, reused, replaced after a timeout, reaped) and the shipped defaults ---------


def _gone(pid: int, within: float = 5.0) -> bool:
    """The process has exited: no /proc entry, or a zombie whose reaping is init's (a grandchild, an orphan)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < within:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _pid_or_hang(x):
    if x == "hang":
        time.sleep(FOREVER)
    if x == "spawn":  # a subprocess of the user code, then a hang: the timeout must take the subprocess too
        return subprocess.Popen(["sleep", str(FOREVER)]).pid
    return os.getpid()


def test_the_worker_is_reused_replaced_after_a_timeout_and_reaped():
    w = Worker(_pid_or_hang, "test")
    assert w.pid is None  # forked lazily
    first = w.call("a", 2.0)
    assert first != os.getpid() and w.call("b", 2.0) == first == w.pid  # one process serves both calls
    grandchild = w.call("spawn", 2.0)
    assert w.pid == first
    t0 = time.perf_counter()
    out = w.map(["hang", "c"], 1.0)
    assert time.perf_counter() - t0 < 8
    assert [k for k, _ in out] == [TIMEOUT, OK] and isinstance(out[0][1], CallTimeout)
    second = out[1][1]
    assert second != first and w.pid == second  # a fresh worker went on
    assert _gone(first) and _gone(grandchild)  # killed with its process group, and reaped (no zombie)
    assert w.call("d", 2.0) == second
    w.close()
    assert w.pid is None and _gone(second, within=0.1)  # reaped by close itself
    assert w.call("e", 2.0) not in (first, second)  # a call after close forks anew
    close_all()
    assert not multiprocessing.active_children()  # nothing left behind, by any test above either


def test_a_task_keeps_one_worker_across_steps():
    """Two scoring batches of one task run in the same worker process (forked once); a second task has its own."""

    class PidTask:
        cfg = SimpleNamespace(reward_timeout_s=2.0)

        def score(self, problem, text):
            return ScoreResult(float(os.getpid()), True)

    probs = [Problem(f"p{i}", "q", "4", "4", {}) for i in range(3)]
    task = PidTask()
    pids = [set(score_batch(task, probs, ["4"] * 3, [1] * 3, [False] * 3, 8, GRPOConfig())[2]) for _ in range(2)]
    assert pids[0] == pids[1] and len(pids[0]) == 1 and os.getpid() not in pids[0]
    other = set(score_batch(PidTask(), probs, ["4"] * 3, [1] * 3, [False] * 3, 8, GRPOConfig())[2])
    assert other.isdisjoint(pids[0])


def test_the_worker_goes_when_the_trainer_is_killed(tmp_path):
    """A trainer killed mid-call (SIGKILL: no exit hook runs) leaves no worker behind."""
    code = (
        "import os, signal, time\n"
        "from twocircuit_jax.tasks.bounded import Worker\n"
        "def f(x):\n"
        "    if x:\n"
        "        time.sleep(10**6)\n"
        "    return os.getpid()\n"
        "w = Worker(f)\n"
        "print(w.call(0, 5.0), flush=True)\n"
        "import threading\n"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()\n"
        "w.call(1, 100.0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert _gone(int(res.stdout.split()[0]), within=5.0)


def test_the_shipped_defaults_bound_user_code():
    """Before, both bounds were off (0) by default: a hung reward function or environment stalled a run forever."""
    assert load_config(data=tiny_config()).task.reward_timeout_s > 0
    assert load_config(data=tiny_config(env={"type": "guess"})).env.step_timeout_s > 0
    assert PyCfg().reward_timeout_s > 0 and GuessEnv().step_timeout_s > 0


class HangingReset(GuessGame):
    """The guessing game with a bug: the problem "R?" never finishes its reset."""

    def reset(self, problem):
        if problem.question == "R?":
            time.sleep(FOREVER)
        return super().reset(problem)


def test_a_hung_environment_reset_fails_its_trajectory(capsys):
    script = {"A?": "16", "A?16>": "24", "A?16>24<": "20"}
    a, r = Problem("a", "A?", "20", "20", {}), Problem("r", "R?", "5", "5", {})
    t0 = time.perf_counter()
    ep = _episodes(1.0, [a, r, a], lambda text: script[text], game=HangingReset)
    assert time.perf_counter() - t0 < 30
    ref = _episodes(0, [a], lambda text: script[text], game=HangingReset)
    assert ep.rewards == [ref.rewards[0], [], ref.rewards[0]] and ep.success == [True, False, True]
    assert ep.reset_timeouts == 1 and ep.step_timeouts == 0 and not ep.timed_out[1]
    assert all(x.traj != 1 for x in ep.turns)  # no turn, so no training row, for the failed trajectory
    m = episode_metrics(ep)
    assert m["env/reset_timeouts"] == 1.0 and "env/reset_timeouts" not in episode_metrics(ref)
    adv = row_advantages(ep, 1, GuessEnv(), GRPOConfig())  # packs: the empty trajectory's return counts as 0
    assert adv[1] == [] and len(adv[0]) == 3
    assert "env.step_timeout_s=1" in capsys.readouterr().err


def _double(x):
    return 2 * x


def test_a_batch_is_bounded_per_call_and_an_unpicklable_argument_fails_alone():
    """Each call of a batch is bounded from its own start (a later, longer batch is not stopped by the position an
    earlier batch left behind), and an argument that cannot be sent fails alone."""
    w = Worker(_double, "test")
    assert w.map([1, 2, 3], 2.0) == [(OK, 2), (OK, 4), (OK, 6)]
    time.sleep(1.2)  # longer than the next bound, since the last call of the first batch started
    assert w.map(list(range(6)), 1.0) == [(OK, 2 * i) for i in range(6)]
    out = w.map([1, threading.Lock(), 3], 2.0)
    assert out[0] == (OK, 2) and out[2] == (OK, 6) and out[1][0] == ERROR and "could not be sent" in str(out[1][1])
    w.close()


def _exit_on(x):
    if x == "die":
        os._exit(3)
    return x * 2


def test_a_worker_that_dies_fails_its_call_and_one_killed_between_calls_fails_none():
    """Inside a call (os._exit, a native crash) the worker's death is that call's failure and the rest of the batch
    goes on in a fresh worker. Killed from outside between calls, with the next batch sent but unread (the pipe then
    reports ConnectionResetError, which once crashed a run stopped by `pkill -f`), no call failed: the batch runs
    whole on a fresh worker."""
    w = Worker(_exit_on, "test")
    out = w.map(["a", "die", "b"], 5.0)
    assert out[0] == (OK, "aa") and out[2] == (OK, "bb")
    assert out[1][0] == ERROR and "died (exit code 3)" in str(out[1][1])
    first = w.pid
    os.kill(first, signal.SIGSTOP)  # idle in its read: the next batch stays in the pipe, unread
    threading.Timer(0.5, lambda: os.kill(first, signal.SIGKILL)).start()
    assert w.map(["c", "d"], 5.0) == [(OK, "cc"), (OK, "dd")]
    assert w.pid not in (None, first) and _gone(first)
    w.close()

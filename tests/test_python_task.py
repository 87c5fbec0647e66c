"""One's own task: Python reward functions on one's own rows (tasks/python_task.py), from Python and from YAML."""

import json
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.config import ConfigError, load_config
from twocircuit_jax.config.sections import PythonTask as PyCfg
from twocircuit_jax.tasks.base import DataError
from twocircuit_jax.tasks.python_task import PythonTask, RewardError, load_function, reward_fns, to_problems

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]


def exact(prompts, completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def short(prompts, completions, **kw):
    return [None if c == "skip" else -len(c) / 10 for c in completions]


def test_weighted_functions_read_the_rows_fields():
    task = PythonTask(PyCfg(), reward_fns([exact, short], [1.0, 0.5]), ROWS)
    probs = task.train_problems()
    assert [p.question for p in probs] == ["1+1=", "2+2=", "3+3="] and task.prompt(probs[0]) == "1+1="
    scores, m = task.score_many(probs, ["2", "5", "skip"])
    assert [s.reward for s in scores] == pytest.approx([1 - 0.05, -0.05, 0.0])
    assert m["reward/exact"] == pytest.approx(1 / 3) and m["reward/short"] == pytest.approx(-0.1)
    assert m["reward/fn_errors"] == 0


def test_a_raising_function_gives_zero_on_its_rows_is_counted_and_stops_past_the_fraction(capsys):
    def picky(prompts, completions, **kw):
        if any(c == "bad" for c in completions):
            raise ValueError("cannot grade 'bad'")
        return [1.0] * len(completions)

    task = PythonTask(PyCfg(max_reward_failure_frac=0.5), reward_fns([picky]), ROWS)
    probs = task.train_problems()
    scores, m = task.score_many(probs, ["ok", "bad", "ok"])  # retried row by row: only row 1 gets 0
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0] and m["reward/fn_errors"] == 1
    err = capsys.readouterr().err
    assert "reward function 'picky' raised" in err and "cannot grade 'bad'" in err and "Traceback" in err
    task.score_many(probs, ["bad", "ok", "ok"])
    assert "Traceback" not in capsys.readouterr().err  # the first traceback only
    with pytest.raises(RewardError, match="2 of 3 .* task.max_reward_failure_frac=0.5"):
        task.score_many(probs, ["bad", "bad", "ok"])
    wrong = PythonTask(PyCfg(), reward_fns([lambda p, c, **k: [1.0]]), ROWS)  # one value for three rows
    scores, m = wrong.score_many(wrong.train_problems()[:1], ["x"])
    assert scores[0].reward == 1.0 and m["reward/fn_errors"] == 0


def test_bad_rows_and_functions_are_named():
    with pytest.raises(DataError, match="row 1: the prompt field 'prompt' is missing"):
        to_problems([{"prompt": "a"}, {"question": "b"}], "prompt", "train", "train_dataset")
    with pytest.raises(DataError, match="chat-message prompts"):
        to_problems([{"prompt": [{"role": "user", "content": "hi"}]}], "prompt", "train", "train_dataset")
    with pytest.raises(ConfigError, match="reward_fns\\[0\\].*expected a callable"):
        reward_fns(["exact"])
    with pytest.raises(ConfigError, match="task.reward_fns\\[0\\].*no function 'nope'"):
        load_function("json:nope", "task.reward_fns[0]")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        load_function("no_such_module:f", "task.reward_fns[0]")
    assert load_function("json:dumps", "x") is json.dumps
    with pytest.raises(ConfigError, match="task.reward_weights"):
        load_config(data={"task": {"type": "python", "reward_fns": ["a:b"], "reward_weights": [1, 2]}})


def write_user_files(tmp_path, body):
    (tmp_path / "my_rewards.py").write_text(body)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    return str(tmp_path / "my_rewards.py"), str(data)


@pytest.mark.slow
def test_cli_python_task_from_yaml_and_a_failing_function_ends_the_run(tmp_path, capsys):
    from twocircuit_jax.cli import main

    body = (
        "def starts_right(prompts, completions, answer, **kw):\n"
        "    return [float(c.startswith(a)) for c, a in zip(completions, answer)]\n\n"
        "def broken(prompts, completions, **kw):\n"
        "    raise KeyError('no grader')\n"
    )
    fns, data = write_user_files(tmp_path, body)
    task = {"type": "python", "reward_fns": [f"{fns}:starts_right"], "train_files": [data], "eval_files": [data]}
    cfg = tiny_config(train={"steps": 1, "eval_every": 0, "eval_size": 4})
    cfg["task"] = task
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(cfg))
    run = str(tmp_path / "ok")
    assert main(["train", "--config", str(tmp_path / "ok.yaml"), "--out", run, "--no-progress"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert "reward/starts_right" in rows[1] and "eval/accuracy" in rows[1]
    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["task"]["type"] == "python" and saved["task"]["reward_fns"] == [f"{fns}:starts_right"]

    cfg["task"] = dict(task, reward_fns=[f"{fns}:starts_right", f"{fns}:broken"], max_reward_failure_frac=0.25)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "bad"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (
        "KeyError: 'no grader'" in err
        and "16 of 32" in err.splitlines()[-1]
        and "task.max_reward_failure_frac=0.25" in err.splitlines()[-1]
    )
    cfg["task"] = dict(task, reward_fns=[f"{fns}:missing"])
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "m")]) == 2
    assert "task.reward_fns[0]" in capsys.readouterr().err and not (tmp_path / "m").exists()


@pytest.mark.slow
def test_trainer_with_a_user_reward_on_a_datasets_Dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    import twocircuit_jax

    train = datasets.Dataset.from_list([{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(8)])
    log = tmp_path / "calls.jsonl"  # the function runs in the task's worker process (task.reward_timeout_s): a
    # list in this process would stay empty, a file is seen

    def right(prompts, completions, answer, level, **kw):
        with open(log, "a") as f:
            f.write(json.dumps([list(prompts), list(answer), list(level), len(completions)]) + "\n")
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    cfg = tiny_config(train={"steps": 1, "eval_every": 0, "eval_size": 4})
    del cfg["task"]  # the default task section: the trainer makes it `type: python`
    tr = twocircuit_jax.GRPOTrainer(
        cfg, str(tmp_path / "r"), reward_fns=[right], train_dataset=train, eval_dataset=train, show_progress=False
    )
    m = tr.step()
    assert m["step"] == 1 and 0.0 <= m["reward/right"] <= 1.0 and m["reward/fn_errors"] == 0
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 3  # evaluation at the start and the end (one call per held-out chunk), the rollouts
    prompts, answer, level, n = seen[1]
    assert n == 4 * 4 == len(prompts) == len(answer) == len(level)  # prompts_per_step x sampler.n
    assert all(str(int(p.split("+")[0]) + 1) == a for p, a in zip(prompts, answer))
    tr.close()
    saved = yaml.safe_load(open(tmp_path / "r" / "config.yaml"))["task"]
    assert saved["type"] == "python" and saved["reward_fns"][0].endswith(
        ":test_trainer_with_a_user_reward_on_a_datasets_Dataset.<locals>.right"
    )
    with pytest.raises(ConfigError, match="task.type: got ReasoningGymTask"):
        twocircuit_jax.GRPOTrainer(tiny_config(), str(tmp_path / "x"), reward_fns=[right], train_dataset=train)

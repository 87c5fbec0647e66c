"""Tasks: reasoning-gym generation/splits/scoring, MATH files loading/boxed extraction/math-verify grading."""

import json

import pytest

from twocircuit_jax.config import ConfigError, from_dict
from twocircuit_jax.config.sections import TaskConfig
from twocircuit_jax.tasks import DataError, Problem, Task, make_task
from twocircuit_jax.tasks.math_files_task import last_boxed
from twocircuit_jax.tasks.reasoning_gym_task import DEMO_OPTIONS


def rg_task(**kw):
    return make_task(from_dict(TaskConfig, {"type": "reasoning_gym", "train_size": 300, "eval_size": 40, **kw}))


def test_reasoning_gym_defaults_are_compact_and_scored_by_the_package():
    task = rg_task()
    assert isinstance(task, Task)
    train = task.train_problems()
    assert len(train) == 300 and all(isinstance(p, Problem) for p in train)
    p = train[0]
    prompt = task.prompt(p)
    assert prompt == p.question + "=" and " " not in prompt and len(prompt) <= 12
    assert p.meta["full_question"].startswith("Calculate")  # the original text is kept
    assert set("".join(q.question for q in train)) <= set("0123456789+-")  # demo options: 1 digit, + and -
    assert {len(q.question.replace("-", "+").split("+")) for q in train} == {2, 3}
    assert eval(p.question) == int(p.answer)  # the compact form is the same problem
    assert task.score(p, p.answer) == (1.0, True, None)
    assert task.score(p, p.answer + "\ngarbage") == (1.0, True, None)  # the answer is the first line
    assert task.score(p, str(int(p.answer) + 1)).reward < 1.0
    assert task.score(p, "") == (0.0, False, None)
    assert task.score(p, "abc").parsed is False
    assert task.reference_completion(p) == p.answer


def test_reasoning_gym_splits_differ_and_are_deduped():
    task = rg_task()
    train_q = {p.question for p in task.train_problems()}
    ev = task.eval_problems()
    assert 0 < len(ev) <= 40
    assert not any(p.question in train_q for p in ev)
    assert len({p.question for p in ev}) == len(ev)
    assert all(p.meta["split"] == "eval" for p in ev)
    # Same seeds, same problems (runs are reproducible).
    again = rg_task()
    assert [p.question for p in again.eval_problems()] == [p.question for p in ev]
    # Held-out problems are scored by the package too.
    assert task.score(ev[0], ev[0].answer).reward == 1.0


def test_reasoning_gym_seed_ranges_do_not_overlap():
    # reasoning-gym seeds entry i with seed + i; adjacent seeds must still give different problems.
    a = rg_task(train_seed=1, options={"max_digits": 3, "min_digits": 3}).train_problems()
    b = rg_task(train_seed=2, options={"max_digits": 3, "min_digits": 3}).train_problems()
    assert len({p.question for p in a} & {p.question for p in b}) < 5


def test_reasoning_gym_chain_sum_and_options_and_template():
    task = rg_task(dataset="chain_sum", options={"max_terms": 2}, prompt_template="Q:{question}=", answer_suffix=";")
    p = task.train_problems()[3]
    assert task.prompt(p) == f"Q:{p.question}="
    assert len(p.question.replace("-", "+").split("+")) == 2
    assert task.score(p, p.answer + ";12") == (1.0, True, None)
    assert task.reference_completion(p) == p.answer + ";"
    full = rg_task(dataset="chain_sum", prompt_template="{full_question}")
    q = full.train_problems()[0]
    assert full.prompt(q).startswith("State the final answer")
    assert set(DEMO_OPTIONS) >= {"basic_arithmetic", "chain_sum"}


def test_reasoning_gym_bad_config_names_the_field():
    with pytest.raises(ConfigError, match="task.dataset"):
        rg_task(dataset="no_such_dataset").train_problems()
    with pytest.raises(ConfigError, match="task.options"):
        rg_task(options={"bogus": 1}).train_problems()
    with pytest.raises(ConfigError, match="task.options"):
        rg_task(options={"min_terms": 5, "max_terms": 2}).train_problems()


# ---------------------------------------------------------------------------------------------------------------
def test_last_boxed_nested_and_edge_cases():
    assert last_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} or rather \boxed{x^{2}+\{a\}}") == r"x^{2}+\{a\}"
    assert last_boxed(r"\boxed 5$.") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box here") is None


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def math_task(tmp_path, train_rows, eval_rows=None, **kw):
    train = write_jsonl(tmp_path / "train.jsonl", train_rows)
    cfg = {"type": "math_files", "train_files": [train], "prompt_template": "Problem: {question}\nAnswer:", **kw}
    if eval_rows is not None:
        cfg["eval_files"] = [write_jsonl(tmp_path / "eval.jsonl", eval_rows)]
    return make_task(from_dict(TaskConfig, cfg))


def test_math_files_jsonl_answers_and_grading(tmp_path):
    rows = [
        {"problem": "Half of one?", "solution": r"It is \boxed{\frac{1}{2}}.", "answer": r"\frac{1}{2}"},
        {"problem": "Expand (x+1)^2", "solution": r"We get \boxed{x^{2}+2x+1}"},  # answer from the solution
        {"problem": "2+2", "answer": 4},
    ]
    task = math_task(tmp_path, rows, eval_rows=rows[:1])
    ps = task.train_problems()
    assert [p.answer for p in ps] == [r"\frac{1}{2}", "x^{2}+2x+1", "4"]
    assert ps[0].id.endswith("train.jsonl:1") and ps[2].solution == r"\boxed{4}"
    assert task.prompt(ps[0]) == "Problem: Half of one?\nAnswer:"
    assert task.score(ps[0], r"so \boxed{0.5}") == (1.0, True, None)
    assert task.score(ps[0], r"\boxed{\dfrac{1}{2}}").reward == 1.0
    assert task.score(ps[0], r"\boxed{\frac{1}{3}}") == (0.0, True, None)
    assert task.score(ps[0], "1/2 without a box") == (0.0, False, None)
    assert task.score(ps[1], r"\boxed{(x+1)^{2}}").reward == 1.0
    assert task.score(ps[1], r"\boxed{x^{2}+1}").reward == 0.0
    assert task.score(ps[2], r"\boxed{4}").reward == 1.0
    assert len(task.eval_problems()) == 1


def test_math_files_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["1+1?", "3*3?"], "sol": [r"\boxed{2}", r"\boxed{9}"]}), f)
    task = make_task(
        from_dict(
            TaskConfig, {"type": "math_files", "train_files": [str(f)], "problem_key": "q", "solution_key": "sol"}
        )
    )
    ps = task.train_problems()
    assert [p.answer for p in ps] == ["2", "9"]
    assert task.eval_problems() == []
    assert task.score(ps[1], r"\boxed{9}").reward == 1.0
    pq.write_table(pa.table({"q": ["1+1?"], "other": ["x"]}), f)
    bad = make_task(from_dict(TaskConfig, {"type": "math_files", "train_files": [str(f)], "problem_key": "q"}))
    with pytest.raises(DataError, match=r"d\.parquet:row 1.*'answer'"):
        bad.train_problems()


@pytest.mark.parametrize(
    "content, pattern",
    [
        ('{"problem": "a", "answer": "1"}\n{not json\n', r"train\.jsonl:line 2: invalid JSON"),
        ('{"problem": "a", "answer": "1"}\n\n{"answer": "2"}\n', r"train\.jsonl:line 3: field 'problem'"),
        ('{"problem": "a", "solution": "no box"}\n', r"line 1: no reference answer.*'answer'.*'solution'"),
        ("[1, 2]\n", r"line 1: expected a JSON object"),
        ('{"problem": ["a"], "answer": "1"}\n', r"line 1: field 'problem' must be a string"),
    ],
)
def test_math_files_malformed_input_names_file_line_field(tmp_path, content, pattern):
    (tmp_path / "train.jsonl").write_text(content)
    task = make_task(from_dict(TaskConfig, {"type": "math_files", "train_files": [str(tmp_path / "train.jsonl")]}))
    with pytest.raises(DataError, match=pattern):
        task.train_problems()


def test_math_files_missing_file_and_bad_extension(tmp_path):
    task = make_task(from_dict(TaskConfig, {"type": "math_files", "train_files": [str(tmp_path / "gone.jsonl")]}))
    with pytest.raises(DataError, match="gone.jsonl: file not found"):
        task.train_problems()
    (tmp_path / "x.csv").write_text("a,b\n")
    task = make_task(from_dict(TaskConfig, {"type": "math_files", "train_files": [str(tmp_path / "x.csv")]}))
    with pytest.raises(DataError, match="x.csv: unsupported extension '.csv'"):
        task.train_problems()
    assert issubclass(DataError, ValueError)

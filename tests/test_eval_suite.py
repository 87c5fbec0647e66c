"""The benchmark suite (`twocircuit eval --suite`): the file's checks, the report (divider, means, plot), and an
end-to-end run of two checkpoints side by side whose numbers match the single-task `twocircuit eval`."""

import json

import pytest
import shared_bases
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.evaluation.report import bar_plot, markdown
from twocircuit_jax.evaluation.suite import load_suite, parse_checkpoints

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
SUITE = {
    "name": "mini",
    "prompt_len": 16,
    "max_new_tokens": 6,
    "size": 24,
    "holdout": {"train_seed": 1, "train_size": 1000},
    "benchmarks": {
        "gcd": {"domain": "out", "dataset": "gcd", "options": {"max_value": 12}, "question": "gcd{numbers}"},
        "chain_sum": {"domain": "in", "dataset": "chain_sum", "options": CHAIN},
    },
}


def _write(tmp_path, d, name="suite.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return str(p)


def test_suite_file_is_checked_and_in_domain_comes_first(tmp_path):
    s = load_suite(_write(tmp_path, SUITE))
    assert [b.name for b in s.benchmarks] == ["chain_sum", "gcd"] and s.holdout_size == 1000
    for bad, where in (
        ({**SUITE, "benchmarks": {"x": {"domain": "sideways", "dataset": "gcd"}}}, "benchmarks.x.domain"),
        ({**SUITE, "benchmarks": {"x": {"domain": "in", "dataset": "gcd", "sise": 3}}}, "benchmarks.x.sise"),
        ({**SUITE, "benchmark": {}}, "benchmark"),
        ({**SUITE, "benchmarks": {}}, "benchmarks"),
    ):
        with pytest.raises(ConfigError) as e:
            load_suite(_write(tmp_path, bad, "bad.yaml"))
        assert where in str(e.value) and "bad.yaml" in str(e.value)


def test_shipped_suite_has_ten_benchmarks_on_both_sides_and_compact_prompts():
    from twocircuit_jax.evaluation.suite import bench_task

    s = load_suite("configs/eval/suite10.yaml")
    assert len(s.benchmarks) == 10 and {b.domain for b in s.benchmarks} == {"in", "out"}
    for b in s.benchmarks:
        task = bench_task(s, b)
        probs = task.eval_problems()
        assert len(probs) >= 50, b.name
        assert max(len(task.prompt(p)) for p in probs) + 1 <= s.prompt_len, b.name  # + BOS
        if b.domain == "in" and b.dataset == "chain_sum":  # held out from the training split
            assert not {p.question for p in probs} & {p.question for p in task.train_problems()}


def test_report_has_the_divider_the_means_and_a_plot(tmp_path):
    res = {
        "suite": "s",
        "checkpoints": ["base", "trained"],
        "benchmarks": [
            {"name": "a", "domain": "in", "dataset": "chain_sum", "n": 4, "accuracy": {"base": 0.25, "trained": 0.75}},
            {"name": "b", "domain": "in", "dataset": "chain_sum", "n": 4, "accuracy": {"base": 0.5, "trained": 1.0}},
            {"name": "c", "domain": "out", "dataset": "gcd", "n": 4, "accuracy": {"base": 0.0, "trained": 0.25}},
        ],
    }
    md = markdown(res).splitlines()
    i_div = next(i for i, ln in enumerate(md) if ln.startswith("| ‖"))
    assert any("in-domain mean" in ln and "0.375" in ln and "0.875" in ln for ln in md[:i_div])
    assert any("out-of-domain" in ln and "| c |" in ln for ln in md[i_div:])
    png = bar_plot(res, str(tmp_path / "s.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_labels(tmp_path):
    (tmp_path / "run" / "checkpoints" / "best").mkdir(parents=True)
    (tmp_path / "base").mkdir()
    got = parse_checkpoints([str(tmp_path / "base"), f"trained={tmp_path}/run/checkpoints/best"])
    assert [g[0] for g in got] == ["base", "trained"]
    assert parse_checkpoints([str(tmp_path / "run" / "checkpoints" / "best")])[0][0] == "checkpoints/best"
    with pytest.raises(ConfigError, match="no such checkpoint"):
        parse_checkpoints([str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="share a label"):
        parse_checkpoints([f"x={tmp_path}/base", f"x={tmp_path}/base"])


@pytest.mark.slow
def test_two_checkpoints_side_by_side_match_the_single_task_eval(tmp_path, capsys, chain_sum_base):
    """A random init and its SFT'd version (conftest's shared chain_sum base, trained on the suite's holdout split:
    train_seed 1, 1000 problems): the trained one wins in-domain; each number is what `twocircuit eval --config`
    reports for the same problems and checkpoint."""
    from twocircuit_jax.config import load_config
    from twocircuit_jax.model.hf_io import save_hf
    from twocircuit_jax.model.tokenizer import load_tokenizer
    from twocircuit_jax.train.setup import load_model

    d = tiny_config(
        model=shared_bases.MODEL,
        task={**shared_bases.TASK, "eval_size": 24, "train_seed": 1, "eval_seed": 7},
        sampler={"sampling": {"max_new_tokens": 6}},
        train={"max_prompt_len": 16, "eval_size": 24},
    )
    assert shared_bases.TASK["options"] == CHAIN and SUITE["holdout"] == {"train_seed": 1, "train_size": 1000}
    cfg = load_config(data=d)
    mcfg, params = load_model(cfg, 0)
    save_hf(mcfg, params, str(tmp_path / "init"), tokenizer=load_tokenizer("char"))
    sft = chain_sum_base[0]  # read-only: only evaluated
    suite = _write(tmp_path, SUITE)
    out = tmp_path / "report"
    args = ["eval", "--suite", suite, "--out", str(out), "--checkpoint", f"init={tmp_path}/init", f"sft={sft}"]
    assert main(args) == 0
    res = json.load(open(out / "mini.json"))
    assert res["checkpoints"] == ["init", "sft"] and (out / "mini.md").is_file() and (out / "mini.png").is_file()
    acc = {r["name"]: r["accuracy"] for r in res["benchmarks"]}
    assert acc["chain_sum"]["sft"] > acc["chain_sum"]["init"] and acc["chain_sum"]["sft"] >= 0.1, acc
    capsys.readouterr()
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(d))
    for label, folder in (("init", tmp_path / "init"), ("sft", sft)):
        assert main(["eval", "--config", str(tmp_path / "cfg.yaml"), "--checkpoint", str(folder)]) == 0
        single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert single["eval/accuracy"] == pytest.approx(acc["chain_sum"][label]), label
    # a benchmark whose prompts do not fit is named, exit 2, nothing written
    bad = _write(tmp_path, {**SUITE, "prompt_len": 4}, "tight.yaml")
    assert main(["eval", "--suite", bad, "--out", str(tmp_path / "r2"), "--checkpoint", str(sft)]) == 2
    err = capsys.readouterr().err
    assert "benchmarks.chain_sum" in err and "prompt_len" in err and not (tmp_path / "r2").exists()

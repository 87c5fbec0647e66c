"""Dense GRPO end to end through the CLI: 3 steps, exact resume, bad input, failing scorer, best checkpoint."""

import json
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main

# end-to-end tests are marked slow: `make test-fast` skips them, `make test` (CI) runs them

TINY = tiny_config(
    name="tiny",
    task={"eval_size": 16},
    train={"steps": 3, "eval_every": 2, "eval_size": 16, "checkpoint_every": 1},
)


# The one-step runs below read their step's metrics alone: no held-out evaluation (before or after) and no
# checkpoint, which the three-step run checks, and which would add work to each of them.
ONE_STEP_EVAL = {"at_start": False, "at_end": False}
ONE_STEP_TRAIN = {"steps": 1, "eval_every": 0, "checkpoint_every": 0, "final_checkpoint": False}


def write_cfg(tmp_path, data=None, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data or TINY))
    return str(p)


def read_metrics(run):
    return [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    run = str(tmp / "run")
    assert main(["train", "--config", write_cfg(tmp), "--out", run, "--no-progress"]) == 0
    return tmp, run


@pytest.mark.slow
def test_three_steps_write_run_folder(three_steps):
    _, run = three_steps
    assert os.path.isfile(os.path.join(run, "config.yaml"))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    for r in rows[1:]:
        for key in (
            "tick",
            "reward/mean",
            "policy/entropy",
            "length/mean",
            "length/max",
            "length/limit_share",
            "length/truncated_frac",
            "grad/norm",
            "kl/ref",
            "ppo/ratio_mean",
            "ppo/clip_frac",
            "lr",
            "time/step_s",
            "time/tokens_per_s",
            "mismatch/prob_gap_mean",
            "mismatch/prob_corr",
        ):
            assert key in r, key
    assert [r["tick"] for r in rows[1:]] == [2, 4, 6]  # two ticks per GRPO step
    # dense JAX sampler vs trainer: the same policy
    assert all(r["mismatch/prob_gap_mean"] < 1e-5 for r in rows[1:])
    # first tick of a step has ratio exactly 1; KL to the reference is 0 before any update
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))
    ck = os.listdir(os.path.join(run, "checkpoints"))
    assert "best" in ck and "step_00000003" in ck


@pytest.mark.slow
def test_exact_resume_after_interrupt(three_steps, monkeypatch):
    from twocircuit_jax.train import loop

    tmp, full = three_steps
    run = str(tmp / "interrupted")
    real = loop.GRPOTrainer.grpo_step

    def dying(self, gs):
        if gs == 3:
            raise KeyboardInterrupt  # killed after step 2's checkpoint
        return real(self, gs)

    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", dying)
    assert main(["train", "--config", write_cfg(tmp), "--out", run, "--no-progress"]) == 130
    monkeypatch.setattr(loop.GRPOTrainer, "grpo_step", real)
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    assert main(["train", "--config", write_cfg(tmp), "--out", run, "--no-progress", "--resume"]) == 0
    a, b = read_metrics(full), read_metrics(run)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a[3:], b[3:]):
        for k, v in ra.items():
            if k.startswith("time/") or not isinstance(v, float):
                continue
            assert rb[k] == pytest.approx(v, abs=1e-6), k


@pytest.mark.slow
def test_bad_config_exits_2_and_writes_nothing(tmp_path, capsys):
    bad = dict(TINY, train=dict(TINY["train"], prompts_per_update=3))
    out = tmp_path / "runs" / "x"
    assert main(["train", "--config", write_cfg(tmp_path, bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.prompts_per_update" in err[0] and "cfg.yaml" in err[0]
    assert not out.exists()
    assert main(["train", "--config", write_cfg(tmp_path), "--out", str(out), "--set", "grpo.tis=maybe"]) == 2
    assert "grpo.tis" in capsys.readouterr().err
    assert not out.exists()
    mf = dict(TINY, task={"type": "math_files", "train_files": [str(tmp_path / "missing.jsonl")]})
    assert main(["train", "--config", write_cfg(tmp_path, mf), "--out", str(out)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_raising_scorer_gives_zero_and_is_counted(tmp_path, monkeypatch):
    from twocircuit_jax.tasks.reasoning_gym_task import ReasoningGymTask

    def boom(self, problem, text):
        raise RuntimeError("verifier bug")

    monkeypatch.setattr(ReasoningGymTask, "score", boom)
    data = dict(TINY, eval=ONE_STEP_EVAL, train=dict(TINY["train"], **ONE_STEP_TRAIN))
    run = str(tmp_path / "r")
    assert main(["train", "--config", write_cfg(tmp_path, data), "--out", run, "--no-progress"]) == 0
    [r] = read_metrics(run)
    assert r["reward/mean"] == 0.0 and r["reward/score_errors"] == 16.0


@pytest.mark.parametrize("cmd", ["train", "sft", "eval", "import-hf", "export-hf", "serve-sampler", "sweep"])
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: twocircuit " + cmd in capsys.readouterr().out


@pytest.mark.slow
def test_each_mismatch_correction_runs_and_logs(tmp_path):
    # Sequence TIS shares token TIS's path through the step (grpo/tis.py correction_weights); its weights are
    # checked against numpy in test_grpo_tis.py. Token TIS (cap 2) runs inside the geometric case: the mask adds to
    # that path and changes none of it, so a token-only run would repeat it (and one more build of the trainer).
    for name, grpo in (
        ("geometric", {"tis": "token", "tis_cap": 2.0, "is_mask": {"type": "geometric"}}),
        ("icepop", {"is_mask": {"type": "icepop"}}),
    ):
        data = dict(TINY, grpo=grpo, eval=ONE_STEP_EVAL, train=dict(TINY["train"], **ONE_STEP_TRAIN))
        run = str(tmp_path / name)
        assert (
            main(["train", "--config", write_cfg(tmp_path, data, f"{name}.yaml"), "--out", run, "--no-progress"]) == 0
        )
        [r] = read_metrics(run)
        # dense JAX sampler: trainer and sampler agree, so every weight is ~1 and nothing is clipped or masked
        assert r["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4) and r["tis/clip_frac"] == 0.0
        assert r["mismatch/ess"] == pytest.approx(1.0, abs=1e-4)
        if "is_mask" in grpo:
            assert r["mismatch/masked_tokens"] == 0 and r["tis/mask_seq_frac"] == 0


@pytest.mark.slow
def test_eval_import_export_round_trip(three_steps, tmp_path, capsys):
    tmp, run = three_steps
    best = os.path.join(run, "checkpoints", "best")
    hf = str(tmp_path / "hf")
    assert main(["export-hf", "--checkpoint", best, "--out", hf, "--tokenizer", "char"]) == 0
    assert os.path.isfile(os.path.join(hf, "config.json")) and os.path.isfile(os.path.join(hf, "tokenizer.json"))
    native = str(tmp_path / "native")
    assert main(["import-hf", "--hf-dir", hf, "--out", native]) == 0
    capsys.readouterr()
    out = str(tmp_path / "eval.json")
    assert main(["eval", "--checkpoint", native, "--config", write_cfg(tmp), "--out", out]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.load(open(out))
    assert printed == saved and saved["eval/n"] == 16
    # the exported policy is the run's best policy: same held-out accuracy as logged at that step
    best_meta = json.load(open(os.path.join(best, "meta.json")))
    logged = {r["step"]: r for r in read_metrics(run)}[best_meta["step"]]
    assert saved["eval/accuracy"] == pytest.approx(logged["eval/accuracy"])
    assert main(["export-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2

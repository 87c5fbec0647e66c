"""`twocircuit sweep`: arms run one after another into their own folders, a table of the four columns at the end;
the shipped seed sweeps resolve, and each arm differs from the base only in its listed keys."""

import glob
import json
import os

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.config.base import to_dict
from twocircuit_jax.config.run import load_config
from twocircuit_jax.train.sweep import load_sweep

# end-to-end tests are marked slow: `make test-fast` skips them, `make test` (CI) runs them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_config(name="tiny", anchor={"cadence": 2, "delay": 2, "projection": {"window": 2}})


def _flat(d, pre=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "options":
            out.update(_flat(v, f"{pre}{k}."))
        else:
            out[f"{pre}{k}"] = v
    return out


@pytest.mark.slow
def test_bad_arm_fails_before_running_anything(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(TINY))
    (tmp_path / "sweep.yaml").write_text(
        yaml.safe_dump({"base": "base.yaml", "arms": {"ok": {}, "typo": {"anchor.cadense": 3}}})
    )
    out = tmp_path / "runs" / "bad"
    assert main(["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "arms.typo" in err and "cadense" in err and not out.exists()


@pytest.mark.slow
def test_sweep_in_parts_parallel_and_resumed_adds_up(tmp_path, capsys):
    """`--arms` runs a subset; `--jobs 2 --resume` then reads the finished arm instead of rerunning it, runs the rest
    in worker processes with their output in OUT/ARM.log, prints the table of every arm, and summary.json holds
    every arm in the file's order. The `--set` reaches every arm, and each arm's config is its own."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(TINY))
    arms = {"dense": {}, "anchored": {"anchor.enabled": True}, "tis": {"grpo.tis": "token"}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": arms}, sort_keys=False))
    out = tmp_path / "s"
    common = ["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out), "--set", "train.steps=1"]
    assert main(common + ["--arms", "tis"]) == 0
    assert sorted(os.listdir(out)) == [".twocircuit.json", "summary.json", "tis"]  # .twocircuit.json: outdir.py
    assert (out / "tis" / "sweep_done.json").is_file()
    first = (out / "tis" / "metrics.jsonl").read_text()
    assert main(common + ["--arms", "dense"]) == 0
    assert main(common + ["--arms", "tis"]) == 2  # a finished arm's folder is not overwritten without --resume
    assert "--resume" in capsys.readouterr().err
    assert main(common + ["--jobs", "2", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "arm tis -> " in text and "finished: read" in text and (out / "tis" / "metrics.jsonl").read_text() == first
    assert (out / "anchored.log").is_file() and not (out / "tis.log").exists()  # only the new arm ran in a worker
    for arm in arms:
        rows = [json.loads(l) for l in open(out / arm / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [0, 1]  # the --set reached every arm
        assert yaml.safe_load(open(out / arm / "config.yaml"))["name"] == f"sweep/{arm}"
        assert ("anchor/fires" in rows[-1]) == (arm == "anchored")
    lines = text.splitlines()
    table = lines[next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["arm", "reward"]) :]
    assert table[0].split() == ["arm", "reward", "heldout_acc", "ref_kl", "gap"]
    body = {ln.split()[0]: ln.split()[1:] for ln in table[2:5]}
    assert set(body) == set(arms) and all(len(v) == 4 and "-" not in v for v in body.values()), table
    summary = json.load(open(out / "summary.json"))
    assert [s["arm"] for s in summary] == ["dense", "anchored", "tis"]
    assert all(s["heldout_acc"] is not None for s in summary)


def test_unknown_arm_and_bad_jobs_are_named(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(TINY))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}, "b": {}}}))
    out = tmp_path / "runs" / "x"
    common = ["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out)]
    assert main(common + ["--arms", "a,nope"]) == 2
    err = capsys.readouterr().err
    assert "--arms" in err and "'nope'" in err and "a, b" in err and not out.exists()
    assert main(common + ["--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err and not out.exists()


SWEEPS = sorted(
    glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml"))
    + glob.glob(os.path.join(ROOT, "configs", "experiments", "*.yaml"))
)


def _covered(key: str, listed) -> bool:
    """A resolved key an arm's listed keys account for: itself, or a key inside a listed section (`fast.codec` covers
    `fast.codec.type` and the rest of a switched section; `grpo.is_mask.type` covers the switched section's other
    keys)."""
    for k in listed:
        if key == k or key.startswith(k + ".") or (k.endswith(".type") and key.startswith(k[: -len("type")])):
            return True
    return False


@pytest.mark.parametrize("path", SWEEPS, ids=[os.path.relpath(p, ROOT) for p in SWEEPS])
def test_shipped_sweeps_resolve_and_differ_only_in_listed_keys(path):
    spec = yaml.safe_load(open(path))
    name, arms = load_sweep(path)
    base = _flat(
        to_dict(
            load_config(
                os.path.join(os.path.dirname(path), spec["base"]),
                [f"{k}={json.dumps(v)}" for k, v in (spec.get("set") or {}).items()],
            )
        )
    )
    assert [a for a, _ in arms] == list(spec["arms"])
    for arm, cfg in arms:
        got = _flat(to_dict(cfg))
        changed = {k for k in got if got[k] != base.get(k)} - {"name"}
        assert all(_covered(k, spec["arms"][arm]) for k in changed), (arm, changed)
        assert got["name"] == f"{name}/{arm}"


def test_shipped_sweeps_are_the_seed_arms():
    _, a0 = load_sweep(os.path.join(ROOT, "configs", "sweeps", "seed000_one_knob.yaml"))
    arms = dict(a0)
    base = arms["compressed"]
    assert base.anchor.enabled and base.fast.codec_type != "none" and base.grpo.clip_high == 0.2
    assert not arms["uncompressed"].anchor.enabled and arms["uncompressed"].fast.codec_type == "none"
    assert arms["anchor_2x"].anchor.cadence * 2 == base.anchor.cadence
    assert not arms["anchor_2x_no_projection"].anchor.projection.enabled
    assert arms["kl_0.01"].grpo.kl_coef == 0.01 and arms["clip_high_0.28"].grpo.clip_high == 0.28
    _, a4 = load_sweep(os.path.join(ROOT, "configs", "sweeps", "seed004_opt_swap.yaml"))
    assert dict(a4)["opt_swap"].anchor.swap.cadence > 0 and dict(a4)["compressed"].anchor.swap.cadence == 0


STRENGTH = {"prf_mask": "p", "lowrank": "rank", "sr_quant": "quant_bits"}  # each codec's strength knob


@pytest.mark.parametrize("name,hidden", [("fidelity_map", 64), ("fidelity_map_wide", 256)])
def test_fidelity_maps_cover_codec_strength_anchor(name, hidden):
    _, arms = load_sweep(os.path.join(ROOT, "configs", "experiments", f"{name}.yaml"))
    cells = {
        (
            c.fast.codec_type,
            getattr(c.fast.codec, STRENGTH[c.fast.codec_type]) if c.fast.codec_type in STRENGTH else None,
            c.anchor.enabled,
        )
        for _, c in arms
    }
    want = {("none", None, False)}
    for anchor in (False, True):
        want |= {("prf_mask", p, anchor) for p in (0.5, 0.75, 0.9, 0.95)}
        want |= {("lowrank", hidden // d, anchor) for d in (4, 8, 16)}
        want |= {("sr_quant", b, anchor) for b in (1, 2, 4)}
    assert cells == want
    assert all(c.model.hidden_size == hidden and c.train.probe_every > 0 for _, c in arms)


@pytest.mark.parametrize("name", ["collapse", "collapse_harsh"])
def test_collapse_experiments_are_one_knob_per_arm(name):
    arms = dict(load_sweep(os.path.join(ROOT, "configs", "experiments", f"{name}.yaml"))[1])
    assert list(arms) == ["dense", "compressed", "anchor", "anchor_tis", "anchor_swap", "anchor_guard", "guard"]
    assert arms["dense"].fast.codec_type == "none" and not arms["dense"].anchor.enabled
    assert arms["compressed"].fast.codec_type == "lowrank" and not arms["compressed"].anchor.enabled
    assert arms["anchor"].anchor.enabled and not arms["anchor"].guard.enabled and arms["anchor"].grpo.tis == "off"
    assert arms["anchor_tis"].grpo.tis == "token" and arms["anchor_swap"].anchor.swap.cadence > 0
    g = arms["anchor_guard"].guard
    assert g.enabled and g.action == "rollback" and arms["anchor_guard"].anchor.swap.cadence == 0
    assert arms["guard"].guard.enabled and not arms["guard"].anchor.enabled  # the guard alone on the compressed arm
    harsh = name == "collapse_harsh"
    a = arms["anchor"]
    want = (4, 2, 16) if harsh else (2, 3, 8)
    assert (a.fast.pp_size, a.fast.codec.rank, a.sampler.sampling.max_new_tokens) == want


@pytest.mark.slow
def test_sweep_resume_checks_each_arms_config_unless_allowed(tmp_path, capsys):
    """`sweep --resume` resumes an arm from its checkpoint under the config check of `train --resume`: a changed
    math key exits 2 naming it (old and new value) and runs nothing; `--allow-config-change` (before: no such flag
    on sweep, so such an arm could not be resumed at all) resumes it with one warning line naming the change."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "checkpoint_every": 1}}))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "arms": {"a": {}}}))
    out = tmp_path / "s"
    common = ["sweep", "--config", str(tmp_path / "sweep.yaml"), "--out", str(out), "--set", "train.steps=1"]
    assert main(common) == 0
    # an arm killed after its step-1 checkpoint, before the sweep marked it done: `--resume` resumes it from there
    os.remove(out / "a" / "sweep_done.json")
    capsys.readouterr()
    again = common + ["--resume", "--set", "train.steps=2", "--set", "optim.lr=0.002"]  # steps may change freely
    # in a worker (before: its ConfigError broke the process pool), then in this process (which keeps the arm's lock
    # after the trainer's __init__ raised: a worker after it would find the folder in use)
    for jobs in ("2", "1"):
        assert main(again + ["--jobs", jobs]) == 2
        err = capsys.readouterr().err
        assert "optim.lr: 0.001 -> 0.002" in err and "--allow-config-change" in err and "train.steps" not in err, err
    assert [json.loads(x)["step"] for x in open(out / "a" / "metrics.jsonl")] == [0, 1]  # nothing ran
    assert main(again + ["--allow-config-change"]) == 0
    err = capsys.readouterr().err
    assert "warning: --resume --allow-config-change: resuming with changed optim.lr: 0.001 -> 0.002" in err, err
    assert [json.loads(x)["step"] for x in open(out / "a" / "metrics.jsonl")] == [0, 1, 2]
    assert (out / "a" / "sweep_done.json").is_file()
    assert yaml.safe_load(open(out / "a" / "config.yaml"))["optim"]["lr"] == 0.002


def test_the_corrections_at_hidden_128_pair_with_the_tuned_ladder_arms():
    """Verdict 4 at hidden 128 reads its uncorrected arm and its dense twin from the ladder sweep: each correction
    arm is the ladder's tuned low-rank arm with that one knob set, and the ladder's dense arm at the same rate is its
    low-rank arm without the codec and the anchor."""
    _, ladder = load_sweep(os.path.join(ROOT, "configs", "sweeps", "ladder_lr.yaml"))
    _, fixes = load_sweep(os.path.join(ROOT, "configs", "sweeps", "mismatch_corrections.yaml"))
    ladder, fixes = dict(ladder), dict(fixes)
    none = _flat(to_dict(ladder["w128_lowrank_lr5e-5"]))
    dense = _flat(to_dict(ladder["w128_dense_lr5e-5"]))
    assert none["model.hidden_size"] == 128 and none["optim.lr"] == 5e-5 and none["fast.codec.type"] == "lowrank"
    assert {k for k in none if dense.get(k) != none[k]} - {"name"} <= {"anchor.enabled"} | {
        k for k in none if k.startswith("fast.codec")
    }
    knobs = {"w128_tis": {"grpo.tis"}, "w128_geometric": {"grpo.is_mask"}, "w128_icepop": {"grpo.is_mask"}}
    for arm, listed in knobs.items():
        got = _flat(to_dict(fixes[arm]))
        changed = {k for k in set(got) | set(none) if got.get(k) != none.get(k)} - {"name"}
        assert changed and all(any(k == c or k.startswith(c + ".") for c in listed) for k in changed), (arm, changed)

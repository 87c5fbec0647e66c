"""The collapse guard end to end, on a synthetic collapse (tests/collapse_task.py: from step 4 the training reward
pays for length, not correctness). A small SFT base (held-out ~0.3) is trained twice, same seed: with the guard off
the run collapses (held-out accuracy to the floor, lengths and truncation up); with the guard on it rolls back to
the best checkpoint, applies its mitigations one per rollback, and ends at the best policy, far above that floor.
Its actions survive a resume."""

import json
import os

import collapse_task  # noqa: F401  (registers task.type synthetic_collapse)
import pytest
import shared_bases
from tiny_run import tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.train.loop import GRPOTrainer

pytestmark = pytest.mark.slow

STEPS = 16


def _cfg(base: str, guard: bool, steps: int = STEPS, action: str = "rollback"):
    d = tiny_config(
        model=shared_bases.MODEL,  # the shared base's model and problems (conftest's chain_sum_base)
        task={
            **shared_bases.TASK,
            "type": "synthetic_collapse",
            "eval_size": 64,
            "collapse_at": 4,
            "collapse_steps": 12,
        },
        sampler={"n": 8, "sampling": {"max_new_tokens": 6}},
        optim={"lr": 1e-3},
        train={"steps": steps, "prompts_per_step": 8, "prompts_per_update": 8, "eval_every": 2, "eval_size": 64},
        health={"smooth": 2, "baseline_steps": 3, "window": 4},
        guard={"enabled": guard, "action": action, "patience": 1, "max_rollbacks": 2, "mitigations": ["kl", "tis"]},
    )
    if base:
        d["base_model"] = base
    return load_config(data=d)


@pytest.fixture(scope="module")
def base(chain_sum_base):
    """The shared SFT base (held-out accuracy ~0.25 on this task's 64 held-out problems), read-only."""
    out, r = chain_sum_base
    assert r["eval/accuracy"] >= 0.2, r  # a base with something to lose
    return out


def _rows(run_dir):
    return [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, guard in (("off", False), ("on", True)):
        d = str(root / name)
        out[name] = (d, GRPOTrainer(_cfg(base, guard), d, show_progress=False).run())
    return out


def test_without_the_guard_the_run_collapses(runs):
    d, summary = runs["off"]
    rows = _rows(d)
    assert summary["base_accuracy"] >= 0.2 and summary["final_accuracy"] <= 0.05, summary
    assert "stopped_by_guard" not in summary and not any("guard/action" in r for r in rows)
    early = [r["length/mean"] for r in rows if 1 <= r["step"] <= 3]
    late = [r["length/mean"] for r in rows if r["step"] >= STEPS - 3]
    assert min(late) > max(early)  # the lengths grew
    assert max(r.get("length/truncated_frac", 0) for r in rows) > 0.1
    assert max(r.get("health/state", 0) for r in rows if r["step"] >= 5) == 2  # the gauges saw it


def test_the_guard_rolls_back_mitigates_and_ends_above_the_floor(runs):
    d, summary = runs["on"]
    off = runs["off"][1]
    actions = [json.loads(line) for line in open(f"{d}/guard.jsonl")]
    assert [a["action"] for a in actions] == ["rollback", "rollback", "final"], actions
    best = json.loads(open(f"{d}/checkpoints/best/COMMITTED").read())
    assert all(a["rollback_to"] == best["step"] for a in actions)
    assert [a["mitigation"] for a in actions[:2]] == ["kl", "tis"]
    assert "reward" in actions[0]["gauges"]
    rows = {r["step"]: r for r in _rows(d)}
    for a in actions:
        assert rows[a["step"]]["guard/action"] == 3.0 and rows[a["step"]]["health/state"] == 2.0
    assert rows[actions[-1]["step"]]["guard/rollbacks"] == 2.0
    # the first rollback's weights are the best step's: the next step starts from a policy as short as it was
    assert summary["stopped_by_guard"] == actions[-1]["step"]
    assert summary["final_accuracy"] == pytest.approx(best["score"])  # it ends at the best policy
    assert summary["final_accuracy"] >= off["final_accuracy"] + 0.15
    meta = json.loads(open(f"{d}/checkpoints/step_{actions[-1]['step']:08d}/meta.json").read())
    assert meta["guard"]["applied"] == ["kl", "tis"] and meta["guard"]["rollbacks"] == 2


def test_guard_actions_and_mitigations_survive_resume(runs, base):
    d, _ = runs["on"]
    before = open(f"{d}/guard.jsonl").read()
    t = GRPOTrainer(_cfg(base, True, steps=STEPS + 2), d, resume=True, show_progress=False)
    try:
        assert (
            t.built.cfg.grpo.kl_coef == pytest.approx(0.01) and t.built.cfg.grpo.tis == "token"
        )  # re-applied from the meta
        assert t.built.guard.rollbacks == 2 and t.built.guard.applied == ["kl", "tis"]
        assert open(f"{d}/guard.jsonl").read() == before
        assert t.built.user_cfg.grpo.kl_coef == pytest.approx(0.001)  # the config as given is what config.yaml keeps
    finally:
        t.built.sampler.close()
        t.logger.close()


def test_the_stop_action_ends_the_run_cleanly_at_the_alarm(base, tmp_path):
    d = str(tmp_path / "stop")
    summary = GRPOTrainer(_cfg(base, True, steps=8, action="stop"), d, show_progress=False).run()
    actions = [json.loads(line) for line in open(f"{d}/guard.jsonl")]
    assert [a["action"] for a in actions] == ["stop"] and summary["stopped_by_guard"] == actions[0]["step"] < 8
    rows = _rows(d)
    assert rows[-1]["step"] == actions[0]["step"] and rows[-1]["guard/action"] == 2.0  # nothing logged after it
    meta = json.loads(open(f"{d}/checkpoints/step_{actions[0]['step']:08d}/meta.json").read())
    assert meta["guard"]["actions"] == actions  # the state it stopped in is saved, with the action


def test_a_run_records_the_base_it_started_from_by_content(runs, base):
    """provenance.json: the base_model path and the sha256 of its files; `compare` reads the fingerprint back."""
    from twocircuit_jax import provenance
    from twocircuit_jax.metrics.runs import load_run

    want = provenance.folder_sha256(base)
    for d, _ in runs.values():
        with open(os.path.join(d, "provenance.json")) as fh:
            assert json.load(fh) == {"base_model": base, "base_model_sha256": want}
        assert load_run(d).base_sha == want

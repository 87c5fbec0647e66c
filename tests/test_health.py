"""Health gauges and guard decisions on synthetic metric series (host-only, no model)."""

import json

import pytest

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.health import GuardConfig, HealthConfig
from twocircuit_jax.metrics.health import ALARM, OK, WARN, HealthMonitor
from twocircuit_jax.train.guard import Guard, apply_mitigations, mitigate

HEALTHY = {
    "policy/entropy": 1.0,
    "length/limit_share": 0.3,
    "length/truncated_frac": 0.0,
    "mismatch/prob_gap_mean": 0.05,
    "mismatch/prob_corr": 0.9,
    "mismatch/kl_k3": 0.02,
    "grad/norm": 1.0,
    "reward/mean": 0.5,
}


def _feed(mon, rows, start=1):
    return [mon.update(start + i, r) for i, r in enumerate(rows)]


def test_a_steady_run_stays_ok():
    mon = HealthMonitor(HealthConfig(baseline_steps=3, window=4, smooth=2))
    out = _feed(mon, [HEALTHY] * 12)
    assert all(h["health/state"] == OK for h in out)
    assert out[-1]["health/gap_ratio"] == pytest.approx(1.0) and out[-1]["health/reward_drop"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "change, gauge",
    [
        ({"length/limit_share": 0.97}, "length"),
        ({"length/truncated_frac": 0.3}, "truncation"),
        ({"mismatch/prob_gap_mean": 0.4}, "mismatch"),  # (0.4 + 0.01) / (0.05 + 0.01) ≈ 6.8 ≥ 4
        ({"mismatch/prob_corr": 0.2}, "mismatch"),  # drop 0.7 ≥ 0.5
        ({"mismatch/kl_k3": 0.5}, "mismatch"),
        ({"grad/norm": 20.0}, "grad"),
        ({"reward/mean": 0.1}, "reward"),
    ],
)
def test_each_gauge_reaches_alarm_on_its_own_signal(change, gauge):
    mon = HealthMonitor(HealthConfig(baseline_steps=3, window=4, smooth=2))
    _feed(mon, [HEALTHY] * 6)
    out = _feed(mon, [dict(HEALTHY, **change)] * 2, start=7)
    assert out[-1][f"health/{gauge}_state"] == ALARM, out[-1]
    assert out[-1]["health/state"] == ALARM and mon.alarming(out[-1]) == [gauge]


def test_length_slope_warns_before_the_cap():
    mon = HealthMonitor(HealthConfig(baseline_steps=3, window=4, smooth=2))
    out = _feed(mon, [dict(HEALTHY, **{"length/limit_share": 0.3 + 0.06 * i}) for i in range(8)])
    assert out[-1]["health/length_slope"] == pytest.approx(0.06) and out[-1]["health/length_state"] == ALARM
    assert out[-1]["health/length_share"] < 0.8  # the level alone would still be ok


def test_entropy_counts_only_up_to_warn_unless_listed():
    drift = [HEALTHY] * 3 + [dict(HEALTHY, **{"policy/entropy": 0.3})] * 4
    mon = HealthMonitor(HealthConfig(baseline_steps=3, window=4, smooth=2))
    h = _feed(mon, drift)[-1]
    assert h["health/entropy_state"] == ALARM and h["health/state"] == WARN
    mon = HealthMonitor(HealthConfig(baseline_steps=3, window=4, smooth=2, alarm_on=("entropy",)))
    assert _feed(mon, drift)[-1]["health/state"] == ALARM


def test_entropy_against_a_dense_arm(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "policy/entropy": 2.0}) + "\n" for s in range(1, 5))
    )
    mon = HealthMonitor(HealthConfig(dense_run=str(tmp_path), smooth=1))
    assert mon.update(1, HEALTHY)["health/entropy_ratio"] == pytest.approx(0.5)  # from step 1, no baseline wait
    with pytest.raises(ConfigError, match="health.dense_run"):
        HealthMonitor(HealthConfig(dense_run=str(tmp_path / "nope")))


def test_monitor_state_round_trips_through_json():
    cfg = HealthConfig(baseline_steps=3, window=4, smooth=2)
    a, b = HealthMonitor(cfg), HealthMonitor(cfg)
    _feed(a, [HEALTHY] * 5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    nxt = dict(HEALTHY, **{"reward/mean": 0.2, "grad/norm": 5.0})
    assert a.update(6, nxt) == b.update(6, nxt)


def test_guard_waits_for_patience_and_escalates(tmp_path):
    g = Guard(GuardConfig(enabled=True, patience=2, max_rollbacks=1, mitigations=("tis", "kl")), str(tmp_path))
    alarm, ok = {"health/state": 2.0}, {"health/state": 0.0}
    assert g.decide(1, alarm, ["reward"]) is None and g.decide(2, ok, []) is None  # the streak broke
    assert g.decide(3, alarm, ["reward"]) is None and g.decide(4, alarm, ["reward"]) == "rollback"
    assert g.next_mitigation() == "tis"
    m = g.record(4, "rollback", ["reward"], rollback_to=0, mitigation="tis")
    assert m == {"guard/action": 3.0, "guard/rollbacks": 1.0, "guard/rollback_to": 0.0}
    assert g.next_mitigation() == "kl"
    g.decide(5, alarm, ["reward"])
    assert g.decide(6, alarm, ["reward"]) == "final"  # rollbacks used up
    assert [json.loads(x)["step"] for x in open(tmp_path / "guard.jsonl")] == [4]
    assert Guard(GuardConfig(enabled=True, action="stop", patience=1), str(tmp_path)).decide(1, alarm, []) == "stop"


def test_mitigations_change_one_knob_each():
    cfg = load_config(
        data={
            "anchor": {"enabled": True, "cadence": 8, "merger": {"cadence": 4}},
            "grpo": {"kl_coef": 0.002},
            "fast": {"pp_size": 4},
        }
    )
    assert mitigate(cfg, "anchor_cadence")[0].anchor.cadence == 4
    assert mitigate(cfg, "kl")[0].grpo.kl_coef == pytest.approx(0.02)
    assert mitigate(cfg, "tis")[0].grpo.tis == "token"
    assert mitigate(cfg, "swap")[0].anchor.swap.cadence == 8
    assert mitigate(cfg, "headroom")[0].sampler.sampling.max_new_tokens == 48  # 32 x 1.5
    both = apply_mitigations(cfg, ["kl", "tis"])
    assert both.grpo.kl_coef == pytest.approx(0.02) and both.grpo.tis == "token" and cfg.grpo.tis == "off"
    zero = load_config(data={"grpo": {"kl_coef": 0.0}, "fast": {"pp_size": 4}})
    assert mitigate(zero, "kl")[0].grpo.kl_coef == pytest.approx(1e-3)
    icepop = load_config(data={"grpo": {"is_mask": {"type": "icepop"}}})  # its kept tokens carry ρ already
    assert apply_mitigations(icepop, ["tis"]).grpo.tis == "off"


def test_guard_config_errors_name_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(data={"guard": {"enabled": True, "mitigations": ["swap"]}, "fast": {"pp_size": 4}})
    assert e.value.path == "guard.mitigations" and "anchor.enabled" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_config(data={"guard": {"mitigations": ["pray"]}})
    assert e.value.path == "guard.mitigations"
    with pytest.raises(ConfigError) as e:
        load_config(data={"health": {"alarm_on": ["vibes"]}})
    assert e.value.path == "health.alarm_on"
    with pytest.raises(ConfigError) as e:
        load_config(data={"health": {"reward_drop_warn": 0.6, "reward_drop_alarm": 0.5}})
    assert e.value.path == "health.reward_drop_alarm"


def test_the_health_command_replays_a_run_folder(tmp_path, capsys):
    from twocircuit_jax.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("health: {baseline_steps: 3, window: 4, smooth: 2}\ntrain: {steps: 12}\n")
    rows = [{"step": 0, "eval/accuracy": 0.3}] + [dict(HEALTHY, step=s) for s in range(1, 7)]
    rows += [
        dict(HEALTHY, step=s, **{"mismatch/prob_gap_mean": 0.2, "reward/mean": 0.5 - 0.1 * (s - 6)})
        for s in range(7, 12)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["health", str(run), "--out", str(tmp_path / "h.json")]) == 0
    rep = json.loads((tmp_path / "h.json").read_text())["run"]
    # the gap alarms the step it jumps (x2.5); the reward (0.4, 0.3, 0.2, ... from step 7): its 2-step mean is half
    # its best (0.5) at step 9
    assert rep["first"]["mismatch"]["alarm"] == 7 and rep["first"]["state"]["alarm"] == 7
    assert rep["reward_half_step"] == 9 and rep["lead"] == 2
    assert "run | 11 | 0.300/0.300/0.300 | 7 | 9 | 2" in capsys.readouterr().out
    # a stricter threshold from the command line moves the alarm; other sections cannot be set here
    assert main(["health", str(run), "--set", "health.gap_ratio_alarm=5", "--out", str(tmp_path / "h2.json")]) == 0
    assert json.loads((tmp_path / "h2.json").read_text())["run"]["first"]["mismatch"]["alarm"] is None
    assert main(["health", str(run), "--set", "train.steps=3"]) == 2

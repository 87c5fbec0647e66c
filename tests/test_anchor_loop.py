"""The anchor circuit through `twocircuit train`: fire markers and counters in metrics.jsonl, merger corrections,
delayed pairing after warm-up, swaps that keep the optimizer shardings and never recompile the train step."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config

pytestmark = pytest.mark.slow  # end-to-end runs: `make test-fast` skips them, `make test` (CI) runs them

# No held-out evaluation and no checkpoint in this file's runs: nothing here reads them (test_grpo_e2e.py checks
# both), and each adds its own programs and work to the run.
NO_EVAL = {"at_start": False, "at_end": False}
TINY = tiny_config(
    name="tiny",
    anchor={"enabled": True, "cadence": 4, "delay": 4, "projection": {"window": 2}, "swap": {"cadence": 2}},
    eval=NO_EVAL,
    train={"steps": 6, "final_checkpoint": False},
)


@pytest.fixture(scope="module")
def anchor_run(tmp_path_factory):
    from twocircuit_jax.cli import main
    from twocircuit_jax.train import loop

    tmp = tmp_path_factory.mktemp("anchor")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(TINY))
    seen = {}
    real = loop.GRPOTrainer.run

    def keep(self):
        seen["trainer"] = self
        return real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop.GRPOTrainer, "run", keep)
        assert main(["train", "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "run"), "--no-progress"]) == 0
    rows = [json.loads(l) for l in open(tmp / "run" / "metrics.jsonl")]  # steps 1..6: no step-0 evaluation
    return rows, seen["trainer"]


def test_fire_markers_counters_merger_and_swaps(anchor_run):
    rows, _ = anchor_run
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # cadence 4 at two ticks per step: fires on ticks 4, 8, 12 = steps 2, 4, 6
    assert [r["anchor/fire"] for r in rows] == [0, 1, 0, 1, 0, 1]
    assert [r.get("anchor/fire_tick") for r in rows] == [None, 4, None, 8, None, 12]
    assert [r["anchor/fires"] for r in rows] == [0, 1, 1, 2, 2, 3]
    assert [r["anchor/backwards"] for r in rows] == [0, 1, 1, 2, 2, 3]
    for r in rows:
        for k in ("anchor/optimizer_steps", "anchor/rollouts_generated", "anchor/rewards_recomputed"):
            assert r[k] == 0, k
        assert r["anchor/retained_batches"] <= 4 // 4 + 1
    # merger bypassed before the first fire, correcting from then on
    assert rows[0]["merger/rel_change"] == 0 and rows[0]["anchor/rank1_bypass_ticks"] == 2
    assert all(r["merger/rel_change"] > 0 for r in rows[2:])
    # after warm-up: data delay K and weight staleness K or K+1 (two ticks per step)
    assert [rows[i]["anchor/data_delay"] for i in (3, 5)] == [4, 4]
    assert all(rows[i]["anchor/weight_staleness"] in (4, 5) for i in (3, 5))
    # the rank-1 forecast is used once the window holds two exact snapshots
    assert all("rank1/evr" in rows[i] and "rank1/r2" in rows[i] for i in (1, 3, 5))
    assert rows[3]["rank1/horizon"] == 4
    # swap every 2 ticks once the anchor has fired: skipped on tick 2, then ticks 4, 6, 8, 10, 12
    assert [r["swap/count"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert "swap/rho" not in rows[0] and all(np.isfinite(r["swap/rho"]) for r in rows[1:])


def test_swap_in_loop_keeps_shardings_and_step_compiles_once(anchor_run):
    _, tr = anchor_run
    assert tr.built.anchor.swaps == 5
    assert tr.built.programs.train_step._cache_size() == 1
    assert tr.built.anchor._fire_jit._cache_size() == 1 and tr.built.anchor._swap_jit._cache_size() == 1
    got = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, tr.state.opt_state))
    want = jax.tree.leaves(tr.built.state_sh.opt_state)
    assert len(got) == len(want) and all(g == w for g, w in zip(got, want))


def test_dense_reference_only_for_the_rows_the_anchor_keeps(tmp_path):
    """Under a codec that acts on the reference pass, the anchor's KL needs ℓ_ref^dense: the loop runs that extra
    forward (codecs off, reference weights) on the mini-batches the anchor keeps only, each kept batch carries the
    dense reference of its own rows, and the train step's inputs never change (one compile)."""
    from twocircuit_jax.config import load_config
    from twocircuit_jax.names import DENSE, REF
    from twocircuit_jax.parallel import dispatch
    from twocircuit_jax.step.passes import make_logp_fn
    from twocircuit_jax.train import loop

    data = tiny_config(
        name="ref_dense",
        grpo={"kl_coef": 0.05},
        fast={"codec": {"type": "prf_mask", "p": 0.5}},
        anchor={"enabled": True, "cadence": 4, "delay": 2, "projection": {"enabled": False, "window": 2}},
        eval=NO_EVAL,
        train={"steps": 4},
    )
    cfg = load_config(data=data)
    with loop.GRPOTrainer(cfg, str(tmp_path / "run"), show_progress=False) as tr:
        assert tr.built.fast.applies(REF)
        calls, real, seen = [], tr.built.programs.logp_anchor_ref, {}

        def spy(params, rows, cs):
            calls.append((int(tr.state.tick) + 1, params is tr.built.ref_params, int(rows["tokens"].shape[0])))
            seen["rows"] = rows
            return real(params, rows, cs)

        tr.built = dataclasses.replace(tr.built, programs=tr.built.programs._replace(logp_anchor_ref=spy))
        rows = []
        for _ in range(3):
            rows.append(tr.step())
        # ticks ≡ 2 (mod 4) are retained (delay 2); without the projection a fire replays them: 2 and 6, 8 rows each
        assert calls == [(2, True, 8), (6, True, 8)]
        assert [r["anchor/fire"] for r in rows] == [0, 1, 0]
        assert all(np.isfinite(r["anchor/kl_loss"]) for r in rows if r["anchor/fire"])
        assert tr.built.programs.train_step._cache_size() == 1
        [(tick, _, kept)] = tr.built.anchor.buffer._batches
        assert tick == 6
        cs, last = tr.cs, seen["rows"]  # tick 6's rows as the loop handed them over (with their sample ids)
        np.testing.assert_array_equal(np.asarray(last["tokens"]), np.asarray(kept["tokens"]))
        dense = dispatch.jit(make_logp_fn(tr.built.model_cfg, None, DENSE))(tr.built.ref_params, last, cs)[0]
        codec_view = dispatch.jit(make_logp_fn(tr.built.model_cfg, tr.built.fast, REF))(tr.built.ref_params, last, cs)[
            0
        ]
        mask = np.asarray(kept["response_mask"]) > 0
        np.testing.assert_allclose(np.asarray(kept["ref_logp_dense"])[mask], np.asarray(dense)[mask], rtol=1e-5)
        assert np.abs(np.asarray(codec_view) - np.asarray(dense))[mask].max() > 0.1  # the views differ here

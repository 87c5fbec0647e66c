"""Rank-1 weight projection (design §4.5, §8.6) and the snapshot history policy."""

import ml_dtypes
import numpy as np
import pytest

from twocircuit_jax.anchor import projection
from twocircuit_jax.anchor.projection import SnapshotWindow, rank1_forecast


def _linear(ticks, seed=0, shape=(6, 5)):
    r = np.random.default_rng(seed)
    base = {
        "a": r.normal(size=shape).astype(np.float32),
        "b": r.normal(size=(7,)).astype(np.float32),
        "ids": np.arange(4, dtype=np.int32),
    }
    vel = {"a": r.normal(size=shape).astype(np.float32), "b": r.normal(size=(7,)).astype(np.float32)}
    snap = lambda t: {
        "a": base["a"] + np.float32(t) * vel["a"],
        "b": base["b"] + np.float32(t) * vel["b"],  # noqa
        "ids": base["ids"],
    }
    return [snap(t) for t in ticks], snap


@pytest.mark.parametrize("ticks", [[1, 21], [1, 21, 41, 61], [3, 10, 31]])
def test_exact_on_linear_trajectory(ticks, monkeypatch):
    monkeypatch.setattr(projection, "CHUNK", 7)  # force streaming across many chunks
    snaps, truth = _linear(ticks)
    fc, met = rank1_forecast(snaps, ticks, target_tick=81)
    want = truth(81)
    np.testing.assert_allclose(fc["a"], want["a"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fc["b"], want["b"], rtol=1e-4, atol=1e-4)
    assert fc["a"].dtype == np.float32 and fc["ids"] is snaps[-1]["ids"]
    assert met["rank1/evr"] == pytest.approx(1.0, abs=1e-6) and met["rank1/r2"] == pytest.approx(1.0, abs=1e-6)
    assert met["rank1/horizon"] == 81 - ticks[-1] and met["rank1/window_span"] == ticks[-1] - ticks[0]
    assert met["rank1/zero_motion"] == 0
    # The forecast must actually move: pinned-to-newest would fail the check above, and strength scales it.
    half, _ = rank1_forecast(snaps, ticks, target_tick=81, strength=0.5)
    np.testing.assert_allclose(half["a"], (snaps[-1]["a"] + want["a"]) / 2, rtol=1e-4, atol=1e-4)


def test_least_squares_slope_and_r2_on_noisy_line():
    # Scalar-direction trajectory with off-line coefficients: c = [0, 1, 3, 4] at t = [0, 1, 2, 3].
    d = np.array([1.0, 0.0], np.float32)
    snaps = [{"w": np.float32(c) * d} for c in (0, 1, 3, 4)]
    fc, met = rank1_forecast(snaps, [0, 1, 2, 3], target_tick=5)
    # LS of (1,3,4) on (1,2,3): slope 1.5, R² = 1 − 0.1667/4.6667.
    np.testing.assert_allclose(fc["w"], np.array([4 + 1.5 * 2, 0]), rtol=1e-6)
    assert met["rank1/r2"] == pytest.approx(1 - (1 / 6) / (14 / 3), rel=1e-6)


def test_zero_motion_returns_newest_snapshot():
    snaps, _ = _linear([1, 2, 3])
    moving = [dict(s, a=snaps[0]["a"]) for s in snaps]  # "a" frozen, "b" moving
    fc, met = rank1_forecast(moving, [1, 2, 3], target_tick=10)
    assert fc["a"] is moving[-1]["a"]
    assert met["rank1/zero_motion"] == 1
    assert not np.array_equal(fc["b"], moving[-1]["b"])


def test_bf16_snapshots_keep_dtype():
    snaps, truth = _linear([0, 4, 8])
    bf = [{k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v) for k, v in s.items()} for s in snaps]
    fc, _ = rank1_forecast(bf, [0, 4, 8], target_tick=12)
    assert fc["a"].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(fc["a"].astype(np.float32), truth(12)["a"], rtol=0.05, atol=0.1)
    f32, _ = rank1_forecast(bf, [0, 4, 8], target_tick=12, out_dtype=np.float32)
    assert f32["a"].dtype == np.float32


def test_raises_on_non_finite_without_touching_inputs():
    snaps, _ = _linear([1, 2, 3])
    snaps[1]["a"][0, 0] = np.nan
    before = [{k: v.copy() for k, v in s.items()} for s in snaps]
    with pytest.raises(FloatingPointError):
        rank1_forecast(snaps, [1, 2, 3], target_tick=4)
    for s, b in zip(snaps, before):
        for k in s:
            np.testing.assert_array_equal(s[k], b[k])
    big, _ = _linear([1, 2], shape=(2, 2))
    with pytest.raises(FloatingPointError):  # finite inputs, overflowing forecast
        rank1_forecast(big, [1, 2], target_tick=2 + 10**40)
    with pytest.raises(ValueError):
        rank1_forecast(big, [2, 1], target_tick=3)


def test_snapshot_window_policies():
    w = SnapshotWindow(window=3, min_snapshots=2, mode="sliding_window")
    assert w.add_base(1, "s1") and not w.add_base(2, "s2")  # only the first generator snapshot is the base
    assert not w.ready
    with pytest.raises(RuntimeError):
        w.forecast(5)
    assert w.add_exact(5, "s5") and w.ready
    assert not w.add_exact(5, "again") and not w.add_exact(3, "older")  # strictly newer only
    w.add_exact(9, "s9")
    w.add_exact(13, "s13")
    assert w.ticks == [5, 9, 13]
    g = SnapshotWindow(window=2, min_snapshots=2, mode="growing_fixed_base", max_snapshots=3)
    g.add_base(1, "s1")
    for t in (5, 9, 13):
        g.add_exact(t, f"s{t}")
    assert g.ticks == [1, 9, 13]
    with pytest.raises(ValueError):
        SnapshotWindow(window=2, min_snapshots=3)


def test_snapshot_window_forecast_end_to_end():
    snaps, truth = _linear([1, 11, 21, 31])
    w = SnapshotWindow(window=3, min_snapshots=2)
    w.add_base(1, snaps[0])
    for t, s in zip([11, 21, 31], snaps[1:]):
        w.add_exact(t, s)
    fc, met = w.forecast(41)
    np.testing.assert_allclose(fc["a"], truth(41)["a"], rtol=1e-4, atol=1e-4)
    assert met["rank1/window_span"] == 20

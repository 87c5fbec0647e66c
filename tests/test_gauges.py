"""Entropy and length gauges."""

import numpy as np
import pytest

from twocircuit_jax.metrics.gauges import entropy_summary, length_slope, length_stats, to_floats


def test_entropy_summary_over_mask():
    e = np.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    s = to_floats(entropy_summary(e, m))
    assert s["policy/entropy"] == pytest.approx(2.0)
    assert s["policy/entropy_max"] == pytest.approx(3.0)
    assert s["policy/entropy_std"] == pytest.approx(np.std([1.0, 2.0, 3.0]))
    assert to_floats(entropy_summary(e, np.zeros_like(m))) == {}


def test_length_stats():
    s = length_stats([4, 8, 16, 16], [False, False, True, False], limit=16)
    assert s == {
        "length/mean": 11.0,
        "length/max": 16.0,
        "length/limit_share": 11.0 / 16,
        "length/truncated_frac": 0.25,
    }
    assert length_stats([], [], 16) == {}
    with pytest.raises(ValueError, match="limit"):
        length_stats([1], [False], 0)
    with pytest.raises(ValueError, match="truncated flags"):
        length_stats([1, 2], [False], 8)


def test_length_slope_last_ten_steps():
    assert length_slope([]) == 0.0 and length_slope([5.0]) == 0.0
    assert length_slope([1.0, 3.0]) == pytest.approx(2.0)
    hist = [100.0] * 20 + [10.0 + 3.0 * i for i in range(10)]  # only the last 10 count
    assert length_slope(hist) == pytest.approx(3.0)
    rng = np.random.default_rng(1)
    y = list(rng.standard_normal(15) * 5 + np.arange(15) * 0.7)
    assert length_slope(y) == pytest.approx(np.polyfit(np.arange(10), y[-10:], 1)[0])
    assert length_slope(y, window=4) == pytest.approx(np.polyfit(np.arange(4), y[-4:], 1)[0])

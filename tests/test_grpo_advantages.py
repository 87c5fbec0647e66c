"""Group advantages against a per-group numpy loop."""

import numpy as np
import pytest

from twocircuit_jax.grpo.advantages import group_advantages


def _ref(r, n, std_normalize, eps=1e-6):
    out = np.zeros_like(r, dtype=np.float64)
    for g in range(len(r) // n):
        x = r[g * n : (g + 1) * n].astype(np.float64)
        sd = x.std(ddof=1) if n > 1 else 0.0
        if sd <= 1e-8:
            continue
        out[g * n : (g + 1) * n] = (x - x.mean()) / (sd + eps) if std_normalize else x - x.mean()
    return out


@pytest.mark.parametrize("std_normalize", [True, False])
def test_matches_reference(std_normalize):
    rng = np.random.default_rng(0)
    r = rng.normal(size=24).astype(np.float32)
    got = np.asarray(group_advantages(r, 4, std_normalize))
    np.testing.assert_allclose(got, _ref(r, 4, std_normalize), rtol=1e-5, atol=1e-6)


def test_groups_are_contiguous_and_zero_mean():
    r = np.array([1, 0, 0, 0, 5, 5, 5, 6], np.float32)
    a = np.asarray(group_advantages(r, 4, True))
    assert a[0] > 0 and np.all(a[1:4] < 0) and a[7] > 0 and np.all(a[4:7] < 0)
    np.testing.assert_allclose(a.reshape(2, 4).sum(1), 0.0, atol=1e-5)
    # unbiased std: [1,0,0,0] has std sqrt(0.25) = 0.5 -> A_0 = 0.75 / 0.5
    np.testing.assert_allclose(a[0], 0.75 / (0.5 + 1e-6), rtol=1e-6)


def test_zero_variance_and_singleton_groups_are_exactly_zero():
    r = np.array([0.1, 0.1, 0.1, 1.0, 0.0, 1.0], np.float32)
    a = np.asarray(group_advantages(r, 3, True))
    assert np.all(a[:3] == 0.0) and np.all(np.isfinite(a))
    assert np.all(np.asarray(group_advantages(r, 1, True)) == 0.0)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(np.zeros(7), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(np.zeros((2, 4)), 4)


def test_jittable():
    import jax

    r = np.arange(8, dtype=np.float32)
    f = jax.jit(group_advantages, static_argnums=(1, 2))
    np.testing.assert_allclose(np.asarray(f(r, 4, True)), np.asarray(group_advantages(r, 4, True)))


@pytest.mark.parametrize("adv_std,ddof", [("unbiased", 1), ("population", 0)])
def test_adv_std_choice_reaches_the_loop_advantages(adv_std, ddof):
    """grpo.adv_std picks the group std's ddof on the path the loop uses (rollout.advantages)."""
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train import rollout as ro

    cfg = load_config(data={"grpo": {"adv_std": adv_std}, "fast": {"pp_size": 4}}).grpo
    r = np.array([1, 0, 0, 0, 3, 1, 0, 0], np.float32)
    g = r.reshape(2, 4).astype(np.float64)
    want = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=ddof, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(ro.advantages(r, 4, cfg), want, rtol=1e-5)
    assert np.asarray(group_advantages(r, 4, True, ddof=ddof)).tolist() == ro.advantages(r, 4, cfg).tolist()


def test_adv_std_rejects_other_values():
    from twocircuit_jax.config import load_config
    from twocircuit_jax.config.base import ConfigError

    with pytest.raises(ConfigError, match="adv_std"):
        load_config(data={"grpo": {"adv_std": "sample"}, "fast": {"pp_size": 4}})

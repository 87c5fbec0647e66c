"""Mismatch metrics against direct numpy computations, identities, splits and jit."""

import jax
import numpy as np
import pytest

from twocircuit_jax.metrics.gauges import to_floats
from twocircuit_jax.metrics.mismatch import mismatch_metrics


def batch(seed=0, B=6, T=9, noise=0.3):
    rng = np.random.default_rng(seed)
    ls = np.log(rng.uniform(0.05, 1.0, (B, T))).astype(np.float32)
    lo = np.minimum(ls + noise * rng.standard_normal((B, T)), 0.0).astype(np.float32)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        mask[b, 2 : 2 + 2 + b] = 1.0  # rows of different lengths, prompt positions masked
    trunc = np.array([True, False, True, False, False, False])
    return lo, ls, mask, trunc


def numpy_reference(lo, ls, mask):
    sel = mask > 0
    po, ps = np.exp(lo[sel]).astype(np.float64), np.exp(ls[sel]).astype(np.float64)
    d = lo[sel].astype(np.float64) - ls[sel]
    gap = np.abs(po - ps)
    w = np.exp(d)
    rows = [b for b in range(lo.shape[0]) if sel[b].any()]
    seq = np.array([np.sum((lo[b] - ls[b])[sel[b]]) for b in rows], np.float64)
    mlo = np.array([lo[b][sel[b]].mean() for b in rows])
    mls = np.array([ls[b][sel[b]].mean() for b in rows])
    return {
        "prob_gap_mean": gap.mean(),
        "prob_gap_max": gap.max(),
        "prob_gap_std": gap.std(),
        "prob_corr": np.corrcoef(po, ps)[0, 1],
        "kl_k1": np.mean(-d),
        "kl_k3": np.mean(np.exp(d) - d - 1),
        "E_rho": w.mean(),
        "chi2_token": np.mean(w**2) - 1,
        "chi2_seq": np.mean(np.exp(2 * seq)) - 1,
        "ess": w.sum() ** 2 / (w.size * np.sum(w**2)),
        "ppl_train": np.mean(np.exp(-mlo)),
        "ppl_roll": np.mean(np.exp(-mls)),
        "log_ppl_diff": np.mean(mls - mlo),
    }


def test_matches_numpy_overall_and_per_split():
    lo, ls, mask, trunc = batch()
    got = mismatch_metrics(lo, ls, mask, truncated=trunc)
    for suffix, rows in (("", slice(None)), ("/truncated", trunc), ("/finished", ~trunc)):
        m = mask * np.asarray(rows if suffix else np.ones(len(trunc), bool), np.float32)[:, None]
        ref = numpy_reference(lo, ls, m)
        for k, v in ref.items():
            np.testing.assert_allclose(float(got[f"mismatch/{k}{suffix}"]), v, rtol=2e-4, atol=1e-6, err_msg=k + suffix)
    # E[rho] = k3 - k1 + 1, as design §6 notes.
    np.testing.assert_allclose(
        float(got["mismatch/E_rho"]), float(got["mismatch/kl_k3"] - got["mismatch/kl_k1"] + 1), rtol=1e-5
    )


def test_identical_logprobs():
    lo, _, mask, trunc = batch()
    got = mismatch_metrics(lo, lo, mask, truncated=trunc)
    for suffix in ("", "/truncated", "/finished"):
        g = {
            k[len("mismatch/") : -len(suffix) or None]: float(v)
            for k, v in got.items()
            if k.endswith(suffix) and (suffix or "/" not in k[len("mismatch/") :])
        }
        assert g["prob_gap_mean"] == 0 and g["prob_gap_max"] == 0 and g["prob_gap_std"] == 0
        assert g["prob_corr"] == pytest.approx(1.0, abs=1e-5)
        assert g["kl_k1"] == 0 and g["kl_k3"] == 0 and g["log_ppl_diff"] == 0
        assert g["ess"] == pytest.approx(1.0) and g["E_rho"] == pytest.approx(1.0)
        assert g["chi2_token"] == pytest.approx(0.0, abs=1e-6) and g["chi2_seq"] == pytest.approx(0.0, abs=1e-6)
        assert g["ppl_train"] == pytest.approx(g["ppl_roll"])


def test_padding_garbage_ignored_and_empty_split_is_nan():
    lo, ls, mask, _ = batch()
    dirty_lo, dirty_ls = lo.copy(), ls.copy()
    dirty_lo[mask == 0], dirty_ls[mask == 0] = -np.inf, 50.0
    clean = mismatch_metrics(lo, ls, mask)
    dirty = mismatch_metrics(dirty_lo, dirty_ls, mask)
    for k in clean:
        np.testing.assert_allclose(float(dirty[k]), float(clean[k]), rtol=1e-6, err_msg=k)
    got = mismatch_metrics(lo, ls, mask, truncated=np.zeros(lo.shape[0], bool))
    assert all(np.isnan(float(v)) for k, v in got.items() if k.endswith("/truncated"))
    assert all(np.isfinite(float(v)) for k, v in got.items() if k.endswith("/finished"))
    logged = to_floats(got)
    assert not any(k.endswith("/truncated") for k in logged) and "mismatch/ess/finished" in logged


def test_ess_with_given_weights_and_large_deltas():
    lo, ls, mask, _ = batch()
    w = np.minimum(np.exp(lo - ls), 2.0)  # TIS-capped weights in use
    got = mismatch_metrics(lo, ls, mask, weights=w)
    ws = w[mask > 0].astype(np.float64)
    np.testing.assert_allclose(float(got["mismatch/ess"]), ws.sum() ** 2 / (ws.size * (ws**2).sum()), rtol=1e-5)
    # Deltas of hundreds of nats: ESS stays finite and small (one dominant weight), no overflow to NaN.
    far = ls.copy()
    far[0, 2] = ls[0, 2] - 200.0
    e = float(mismatch_metrics(lo, far, mask)["mismatch/ess"])
    n = mask.sum()
    assert np.isfinite(e) and e == pytest.approx(1.0 / n, rel=1e-3)


def test_jit_and_divergence_direction():
    lo, ls, mask, trunc = batch()
    f = jax.jit(lambda a, b, m, t: mismatch_metrics(a, b, m, truncated=t))
    got = f(lo, ls, mask, trunc)
    ref = mismatch_metrics(lo, ls, mask, truncated=trunc)
    for k in ref:
        np.testing.assert_allclose(float(got[k]), float(ref[k]), rtol=1e-5, equal_nan=True)
    near = mismatch_metrics(lo, lo + 0.01 * (ls - lo), mask)
    assert float(near["mismatch/kl_k3"]) < float(ref["mismatch/kl_k3"])
    assert float(near["mismatch/ess"]) > float(ref["mismatch/ess"])
    assert float(ref["mismatch/kl_k3"]) > 0

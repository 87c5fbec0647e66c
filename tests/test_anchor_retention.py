"""Delayed pairing and retention (design §4.2, §8.4): bound, exact delays, canary."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from twocircuit_jax.anchor.retention import CanaryMismatchError, ReplayBuffer, ReplayInvariantError


def _params(tick):
    """Live weights whose values name the tick they belong to (so the test can check which snapshot came back)."""
    return {
        "layers": {
            "q_proj": {"kernel": np.full((2, 3, 4), tick, np.float32)},
            "down_proj": {"kernel": np.full((2, 4, 3), -tick, np.float32)},
        },
        "final_norm": np.full((3,), 0.5 * tick, np.float32),
        "ids": np.arange(3, dtype=np.int32),
    }


def _run(cadence, delay, tps, ticks=200):
    buf = ReplayBuffer(cadence, delay, sampler_dtype="bfloat16")
    fires = []
    for tau in range(1, ticks + 1):
        step = (tau - 1) // tps + 1
        first = (tau - 1) % tps == 0
        buf.on_tick(tau, step, {"tick": tau}, params=_params(tau) if first else None)
        assert buf.num_batches <= delay // cadence + 1
        assert buf.num_snapshots <= delay // cadence + 2  # retained batches' steps + the current step
        if tau % cadence == 0:
            fires.append((tau, buf.replay_for_fire(tau)))
            assert buf.num_batches <= delay // cadence + 1
    return buf, fires


@pytest.mark.parametrize("cadence,delay", [(20, 20), (4, 4), (4, 5), (10, 3), (5, 12), (6, 0)])
@pytest.mark.parametrize("tps", [1, 2, 3])
def test_bound_and_exact_delays(cadence, delay, tps):
    _, fires = _run(cadence, delay, tps)
    assert fires
    warm = [(tau, r) for tau, r in fires if tau - delay >= 1]
    assert warm and all(r.warm for _, r in warm)
    for tau, r in fires:
        assert r.batch == {"tick": r.batch_tick}
        # The snapshot is the first-tick weights of the batch's step, stored in the sampler dtype.
        q = r.params["layers"]["q_proj"]["kernel"]
        assert q.dtype == ml_dtypes.bfloat16 and r.params["ids"].dtype == np.int32
        assert float(q.astype(np.float32)[0, 0, 0]) == float(np.float32(r.snapshot_tick).astype(ml_dtypes.bfloat16))
        assert r.snapshot_tick == (r.batch_tick - 1) // tps * tps + 1
        if r.warm:
            assert r.data_delay == delay and r.batch_tick == tau - delay
            assert delay <= r.weight_staleness <= delay + tps - 1
            if tps == 2:
                assert r.weight_staleness in (delay, delay + 1)
        else:  # warm-up: the oldest retained batch, never from the future
            assert r.batch_tick <= tau


def test_two_batches_at_20_20_and_staleness_k_plus_one():
    buf, fires = _run(20, 20, 2, ticks=100)
    assert buf.max_batches == 2
    stale = {r.weight_staleness for tau, r in fires if r.warm}
    assert stale == {21}  # batch ticks 20, 40, … are the second tick of their step


def test_warmup_uses_oldest_retained():
    buf = ReplayBuffer(4, 6, sampler_dtype="float32")
    for tau in range(1, 5):
        buf.on_tick(tau, tau, f"b{tau}", params=_params(tau))
    r = buf.replay_for_fire(4)  # τ−K = −2 does not exist; retained ticks ≡ 2 (mod 4): {2}
    assert not r.warm and r.batch == "b2" and r.data_delay == 2
    assert buf.retained_ticks == [2]  # still needed by the fire at 8


def test_canary_detects_flipped_bit_and_snapshot_is_a_copy():
    buf = ReplayBuffer(4, 4, sampler_dtype="bfloat16")
    live = _params(1)
    buf.on_tick(1, 1, "b1", params=live)
    live["layers"]["down_proj"]["kernel"][:] = np.nan  # poisoned live weights must not reach the anchor
    for tau in range(2, 5):
        buf.on_tick(tau, 1, f"b{tau}")
    r = buf.replay_for_fire(4)
    assert np.all(np.isfinite(r.params["layers"]["down_proj"]["kernel"].astype(np.float32)))
    with pytest.raises(ValueError):  # snapshots are read-only to the anchor
        r.params["layers"]["down_proj"]["kernel"][0, 0, 0] = 0
    for tau in range(5, 9):
        buf.on_tick(tau, 2, f"b{tau}", params=_params(5) if tau == 5 else None)
    # Flip one low mantissa bit of the first-sorted 2-D+ tensor of step 1's stored snapshot.
    arr = r.params["layers"]["down_proj"]["kernel"]
    arr.setflags(write=True)
    arr.view(np.uint16)[1, 2, 0] ^= 1
    with pytest.raises(CanaryMismatchError):
        buf.replay_for_fire(8)


def test_contract_errors():
    buf = ReplayBuffer(4, 4)
    with pytest.raises(ValueError, match="params"):
        buf.on_tick(1, 1, "b1")
    buf.on_tick(1, 1, "b1", params={"w": jnp.ones((2, 2))})
    with pytest.raises(ValueError, match="consecutive"):
        buf.on_tick(3, 1, "b3")
    buf2 = ReplayBuffer(2, 4)
    for tau in range(1, 5):  # skip the fire at 2: the batch of tick 2 is never consumed, so the bound trips
        buf2.on_tick(tau, tau, tau, params={"w": np.ones((2, 2), np.float32)})
    with pytest.raises(ReplayInvariantError):
        for tau in range(5, 9):
            buf2.on_tick(tau, tau, tau, params={"w": np.ones((2, 2), np.float32)})

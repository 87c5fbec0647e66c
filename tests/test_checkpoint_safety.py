"""Checkpoints hold data only: the host-side parts round-trip bit for bit without pickle, and a planted pickle (the
old format's file, or one in the new file's place) is refused with the file named and never executed."""

import json
import os
import pickle

import ml_dtypes
import numpy as np
import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.cli import main
from twocircuit_jax.train import safe_blob
from twocircuit_jax.train.run_checkpoints import AHEAD_BLOB, ANCHOR_BLOB


class _Boom:
    """Unpickling this runs `open(marker, "w")`: what a hostile checkpoint would do, harmlessly."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_blob_round_trip_is_exact_and_keeps_types():
    rng = np.random.default_rng(0)
    tree = {
        3: (3, 7, {"w": rng.standard_normal((4, 5)).astype(ml_dtypes.bfloat16)}, (("a/b", b"\x00\xff\x10"),)),
        "batches": [(1, 2, {"tokens": rng.integers(0, 9, (2, 3), dtype=np.int32)})],
        "f32": np.float32(np.nan),
        "i64": np.int64(-5),
        "flags": [True, False, None],
        "x": 1.5,
        "big": 2**62,
        "empty": np.zeros((0, 3), np.float16),
        (1, 2): "tuple key",
    }
    out = safe_blob.loads(safe_blob.dumps(tree), "t")
    assert set(out) == set(tree)
    assert isinstance(out[3], tuple) and out[3][:2] == (3, 7) and out[3][3] == (("a/b", b"\x00\xff\x10"),)
    w = out[3][2]["w"]
    assert w.dtype == ml_dtypes.bfloat16 and np.array_equal(w.view(np.uint16), tree[3][2]["w"].view(np.uint16))
    b = out["batches"][0]
    assert isinstance(b, tuple) and b[:2] == (1, 2) and b[2]["tokens"].dtype == np.int32
    assert np.array_equal(b[2]["tokens"], tree["batches"][0][2]["tokens"])
    assert isinstance(out["f32"], np.float32) and np.isnan(out["f32"])
    assert isinstance(out["i64"], np.int64) and out["i64"] == -5
    assert out["flags"] == [True, False, None] and out["x"] == 1.5 and out["big"] == 2**62
    assert out["empty"].shape == (0, 3) and out["empty"].dtype == np.float16
    assert out[(1, 2)] == "tuple key"
    with pytest.raises(TypeError, match=r"blob\['o'\]: _Boom"):
        safe_blob.dumps({"o": _Boom("x")})
    with pytest.raises(TypeError, match="object array"):
        safe_blob.dumps({"o": np.array([None, 1], dtype=object)})


def test_a_pickle_or_object_array_in_a_part_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(safe_blob.BlobError, match="part.npz: not a data-only"):
        safe_blob.loads(pickle.dumps(_Boom(str(marker))), "part.npz")
    import io

    buf = io.BytesIO()
    np.savez(buf, __tree__=np.frombuffer(b'{"a": "a0", "dtype": "float32"}', np.uint8), a0=np.array([_Boom("m")]))
    with pytest.raises(safe_blob.BlobError, match="part.npz"):
        safe_blob.loads(buf.getvalue(), "part.npz")
    assert not marker.exists()


# The anchor (replay buffers) and async rollouts (the step-ahead batch) on: both parts are in every checkpoint.
CFG = tiny_config(
    name="safe_ckpt",
    anchor={"enabled": True, "cadence": 2, "delay": 1},
    train={"steps": 3, "checkpoint_every": 2, "async_rollouts": 1, "final_checkpoint": False},
)


@pytest.mark.slow
def test_resume_refuses_a_planted_pickle_and_runs_nothing(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--out", str(run), "--no-progress"]
    assert main(argv) == 0
    blobs = run / "checkpoints" / "step_00000002" / "blobs"
    assert sorted(os.listdir(blobs)) == sorted([ANCHOR_BLOB, AHEAD_BLOB])
    marker = tmp_path / "code_ran"
    bomb = pickle.dumps(_Boom(str(marker)))

    # 1. the old format's file beside the new ones (a checkpoint of an older release): refused, named, not read
    (blobs / "anchor_buffers.pkl").write_bytes(bomb)
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "anchor_buffers.pkl" in err and "pickle" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()
    os.remove(blobs / "anchor_buffers.pkl")

    # 2. a pickle in the new file's place: refused by the data-only reader, named, not run
    for name in (ANCHOR_BLOB, AHEAD_BLOB):
        good = (blobs / name).read_bytes()
        (blobs / name).write_bytes(bomb)
        assert main(argv + ["--resume"]) == 2
        err = capsys.readouterr().err
        assert name in err and "not a data-only checkpoint part" in err
        assert not marker.exists()
        (blobs / name).write_bytes(good)

    # 3. a checkpoint of another state layout, or one whose merger state is not this merger's: one line saying
    # what to do instead, exit 2, and the checkpoint left as it was
    meta_path = run / "checkpoints" / "step_00000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["merger_state"] is not None  # the anchor's merger keeps a state: the check below can fail
    for change, words in (
        ({"state_layout": 1}, ("state layout 1", "reads layout 2 only", "start a new run")),
        ({"state_layout": 99}, ("state layout 99", "reads layout 2 only")),
        ({"merger_state": "LegacyMergerState"}, ("merger state is LegacyMergerState", "start a new run")),
    ):
        meta_path.write_text(json.dumps({**meta, **change}))
        assert main(argv + ["--resume"]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
        assert len(err.strip().splitlines()) == 1, err
    stripped = dict(meta)
    del stripped["merger_state"]
    meta_path.write_text(json.dumps(stripped))
    assert main(argv + ["--resume"]) == 2
    assert "before the per-merger states" in capsys.readouterr().err
    meta_path.write_text(json.dumps(meta))
    assert main(argv + ["--resume"]) == 0  # the checkpoint itself is untouched: the run resumes from it

"""train/provenance.py: a base folder's fingerprint is its files' names and bytes, nothing else."""

import os
import shutil

from twocircuit_jax.provenance import folder_sha256, read, write


def _base(path):
    os.makedirs(os.path.join(path, "sub"), exist_ok=True)
    with open(os.path.join(path, "model.safetensors"), "wb") as fh:
        fh.write(bytes(range(256)) * 5000)  # past one 1 MiB read
    with open(os.path.join(path, "sub", "config.json"), "w") as fh:
        fh.write('{"hidden_size": 64}')
    return str(path)


def test_the_fingerprint_follows_the_bytes_and_names_not_the_place_or_times(tmp_path):
    a = _base(tmp_path / "a")
    b = str(tmp_path / "elsewhere" / "b")
    shutil.copytree(a, b)
    os.utime(os.path.join(b, "model.safetensors"), (1, 1))
    with open(os.path.join(b, ".twocircuit.json"), "w") as fh:  # the output-folder marker is not the model
        fh.write('{"kind": "hf", "files": []}')
    fa = folder_sha256(a)
    assert len(fa) == 64 and folder_sha256(b) == fa
    with open(os.path.join(b, "model.safetensors"), "r+b") as fh:  # one byte past the first MiB
        fh.seek(1 << 20)
        x = fh.read(1)
        fh.seek(1 << 20)
        fh.write(bytes([x[0] ^ 1]))
    assert folder_sha256(b) != fa
    c = str(tmp_path / "c")
    shutil.copytree(a, c)
    os.rename(os.path.join(c, "sub", "config.json"), os.path.join(c, "sub", "config2.json"))  # same bytes, new name
    assert folder_sha256(c) != fa


def test_write_and_read(tmp_path):
    base = _base(tmp_path / "base")
    run = tmp_path / "run"
    run.mkdir()
    assert read(str(run)) == {}  # a run from before the record: nothing said
    info = write(str(run), base)
    assert info == {"base_model": base, "base_model_sha256": folder_sha256(base)} == read(str(run))
    assert write(str(run), None) == {"base_model": None, "base_model_sha256": None}  # a random init
    assert sorted(os.listdir(run)) == ["provenance.json"]  # no temporary left
    (run / "provenance.json").write_text("{torn")
    assert read(str(run)) == {}

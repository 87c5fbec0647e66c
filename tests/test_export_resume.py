"""Sampler exports after a crash: a resumed run's first version survives the dead run's newer ones, a rollback
writes whole, and /dev/shm export folders of dead runs are removed (real export folders, no engine).

The end-to-end kill-and-resume with the vLLM engine is tests/test_vllm_resume.py."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from hf_models import TINY_VLLM

from twocircuit_jax.model import init_params
from twocircuit_jax.sampler import export as ex, weight_publish as wp, weight_receive as wr, weight_words as ww

CFG = TINY_VLLM


def _step(params, k):
    """Version k's weights: a few words of every leaf moved (a delta stays small)."""
    key = jax.random.PRNGKey(100 + k)
    return jax.tree.map(lambda x: x + 1e-3 * (jax.random.uniform(key, x.shape) < 0.02), params)


def _words(tree, dtype="float32"):
    return [ww.words(np.asarray(x, dtype)) for x in jax.tree.leaves(jax.device_get(tree))]


def _rebuilt(root, v):
    return _words(wr.rebuild(root, v)[1])


def test_resume_keeps_the_version_it_writes_over_a_dead_runs_newer_exports(tmp_path):
    root = str(tmp_path / "exports")
    p0 = init_params(CFG, jax.random.PRNGKey(0))
    versions = {0: p0}
    dead = wp.WeightPublisher(root, CFG, "float32", full_every=20)
    for v in range(26):  # the killed run: full v0 and v20, deltas in between, killed after v25
        versions[v] = _step(versions[v - 1], v) if v else p0
        dead.publish(versions[v], v)
    assert ex.list_versions(root) == [20, 21, 22, 23, 24, 25]  # keep 3, back to v20, the newest full base
    assert json.load(open(os.path.join(ex.version_dir(root, 20), "meta.json")))["kind"] == "full"

    # The resumed run restarts from its step-15 checkpoint with a fresh publisher (a new process).
    resumed = wp.WeightPublisher(root, CFG, "float32", full_every=20)
    assert resumed.publish(versions[15], 15).kind == "full"
    # Before the fix prune kept 23-25 and their chain back to v20, and deleted the v15 just written.
    assert ex.list_versions(root) == [15]
    assert _same(_rebuilt(root, 15), _words(versions[15]))
    later = {15: versions[15]}
    for v in (16, 17, 18, 19):
        later[v] = _step(later[v - 1], 1000 + v)
        assert resumed.publish(later[v], v).kind == "delta"
    assert ex.list_versions(root) == [15, 16, 17, 18, 19]  # deltas 17-19 keep their chain back to the full v15
    assert _same(_rebuilt(root, 19), _words(later[19]))


def test_a_step_back_is_written_whole_and_drops_the_newer_versions(tmp_path):
    """A guard rollback publishes an older (or the same) step: it must not be a delta against a discarded one."""
    root = str(tmp_path / "exports")
    p = {0: init_params(CFG, jax.random.PRNGKey(0))}
    pub = wp.WeightPublisher(root, CFG, "float32", full_every=20)
    for v in range(1, 6):
        p[v] = _step(p.get(v - 1, p[0]), v)
        pub.publish(p[v], v)
    assert pub.publish(p[3], 5).kind == "full"  # same number again (rollback at step 5): whole
    assert _same(_rebuilt(root, 5), _words(p[3]))
    assert pub.publish(p[2], 4).kind == "full"
    assert ex.list_versions(root) == [1, 2, 3, 4]  # v5 is gone; 2-3 are deltas kept with their full base v1
    assert _same(_rebuilt(root, 4), _words(p[2]))


def test_prune_never_deletes_the_version_just_written(tmp_path):
    root = str(tmp_path)
    params = init_params(CFG, jax.random.PRNGKey(0))
    for v in (30, 31, 32):
        ex.export_weights(params, CFG, root, v, keep=3)
    ex.export_weights(params, CFG, root, 7, keep=2)  # older number than what is on disk
    assert ex.list_versions(root) == [7, 31, 32]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _folder(shm, name, owner):
    path = os.path.join(shm, name)
    os.makedirs(os.path.join(path, "v00000001"))
    if owner is not None:
        with open(os.path.join(path, ex.OWNER), "w") as fh:
            json.dump(owner, fh)
    return path


def test_shm_exports_of_dead_runs_are_removed_on_the_next_start(tmp_path):
    shm = str(tmp_path)
    host, dead = socket.gethostname(), _dead_pid()
    stale = _folder(shm, "twocircuit-exports-aaa", {"pid": dead, "machine": host})
    alive = _folder(shm, "twocircuit-exports-bbb", {"pid": os.getppid(), "machine": host})
    other_host = _folder(shm, "twocircuit-exports-ccc", {"pid": dead, "machine": host + "-elsewhere"})
    no_owner = _folder(shm, "twocircuit-exports-ddd", None)  # an older release's folder: owner unknown
    not_ours = _folder(shm, "someone-exports-eee", {"pid": dead, "machine": host})
    mine = ex.make_shm_root(shm)
    assert not os.path.exists(stale)
    for path in (alive, other_host, no_owner, not_ours, mine):
        assert os.path.isdir(path), path
    assert json.load(open(os.path.join(mine, ex.OWNER))) == {"pid": os.getpid(), "machine": host}
    assert os.path.basename(mine).startswith(ex.SHM_PREFIX)
    # the owner's own folder is never removed by itself, and a second start of this process keeps it
    assert ex.remove_dead_shm_roots(shm) == []


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))

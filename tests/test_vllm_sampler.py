"""The vLLM sampler process end to end: ONE server for the whole module (engine start is ~20 s on CPU).

Tests run in file order and share the server; each leaves it serving a known version. The real server's half of
tests/test_sampler_security.py is here too, on this server (its stall limit, 2 s, is that test's).
"""

import dataclasses
import functools
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

from hf_models import TINY_VLLM  # noqa: E402
from test_sampler_security import call, no_file_holds, post  # noqa: E402

from twocircuit_jax.config.sections import SamplerConfig, SamplingConfig  # noqa: E402
from twocircuit_jax.model import init_params, save_hf  # noqa: E402
from twocircuit_jax.sampler import export as ex  # noqa: E402
from twocircuit_jax.sampler.vllm_client import SamplerError, VLLMSampler  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = TINY_VLLM
PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14]]
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    # std 0.3: a peaked policy, so log-prob comparisons are not all near log(1/V).
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.PRNGKey(0), std=0.3))
    save_hf(CFG, params, str(root / "model"))
    # stall_timeout_s: /health reports a load stuck for 2 s (test_the_real_server_refuses_serves_and_reports_a_stuck_load)
    cfg = SamplerConfig(startup_timeout_s=240, request_timeout_s=120, max_retries=2, stall_timeout_s=2.0)
    s = VLLMSampler(
        cfg,
        str(root / "model"),
        str(root / "exports"),
        CFG,
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_model_len=256,
    )
    try:
        yield s, params, root
    finally:
        s.close()


def _check_rollout(r, rows, max_new, eos=2):
    assert len(r.tokens) == len(r.logprobs) == len(r.truncated) == rows
    for t, lp, tr in zip(r.tokens, r.logprobs, r.truncated):
        assert 1 <= len(t) <= max_new and len(lp) == len(t)
        assert all(x <= 0 and math.isfinite(x) for x in lp)
        if tr:
            assert len(t) == max_new and t[-1] != eos
        else:
            assert t[-1] == eos and eos not in t[:-1]


def test_generate_shapes_and_determinism(setup):
    s, _, _ = setup
    r = s.generate(PROMPTS, 4, SAMPLING, seed=3)
    _check_rollout(r, 12, 8)
    assert r.weight_version == 0
    again = s.generate(PROMPTS, 4, SAMPLING, seed=3)
    assert again.tokens == r.tokens
    assert s.generate(PROMPTS, 4, SAMPLING, seed=4).tokens != r.tokens
    # Per-prompt seeds: different prompts do not share one noise stream.
    assert r.tokens[0:4] != r.tokens[4:8]


@functools.lru_cache(maxsize=1)  # one load for the test's six rows
def _hf_model(model_dir):
    if "torchaudio" not in sys.modules:  # a torchaudio built for another torch breaks `import transformers`
        try:
            import torchaudio  # noqa: F401
        except Exception:  # noqa: BLE001
            sys.modules["torchaudio"] = None
    import torch
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(model_dir, prompt, resp):
    import torch

    model = _hf_model(model_dir)
    ids = torch.tensor([prompt + resp])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(resp)]


def test_logprobs_match_transformers(setup):
    s, _, root = setup
    r = s.generate(PROMPTS, 2, SAMPLING, seed=11)
    gaps = []
    for i, (toks, lps) in enumerate(zip(r.tokens, r.logprobs)):
        ref = _hf_logprobs(str(root / "model"), PROMPTS[i // 2], toks)
        gaps += [abs(a - b) for a, b in zip(lps, ref)]
    gaps = np.asarray(gaps)
    print(
        f"\nvLLM vs transformers fp32 sampled-token logprob gap: max {gaps.max():.3e} mean {gaps.mean():.3e} "
        f"over {gaps.size} tokens"
    )
    assert gaps.max() < 1e-3, gaps.max()


def test_update_weights_changes_outputs_and_version(setup):
    s, params, _ = setup
    before = s.generate(PROMPTS, 4, SAMPLING, seed=5)
    flat = dict(params, lm_head=np.zeros_like(params["lm_head"]))  # uniform policy: every logprob is -log V
    s.update_weights(flat, 1)
    r = s.generate(PROMPTS, 16, SAMPLING, seed=5)
    assert r.weight_version == 1 and s.metrics()["sampler/weight_version"] == 1
    _check_rollout(r, 48, 8)
    np.testing.assert_allclose(np.concatenate(r.logprobs), -math.log(CFG.vocab_size), atol=1e-5)
    assert any(not t for t in r.truncated), "uniform policy over 96 tokens should emit EOS somewhere"
    s.update_weights(params, 2)  # back to the original weights: the outputs come back exactly
    after = s.generate(PROMPTS, 4, SAMPLING, seed=5)
    assert after.weight_version == 2
    assert after.tokens == before.tokens
    np.testing.assert_allclose(np.concatenate(after.logprobs), np.concatenate(before.logprobs), atol=1e-6)


def _served(s) -> int:
    """The version the server reports on /health (not the client's own record)."""
    status, body = call(s.address[1], "GET", "/health", {"Authorization": f"Bearer {s._token}"})
    assert status == 200, body
    return body["version"]


def test_missing_or_corrupt_export_keeps_previous_version(setup):
    """Each failed load leaves the server on version 2, the one the test before loaded."""
    s, params, root = setup
    assert _served(s) == s.latest == 2
    with pytest.raises(SamplerError, match="still serving 2\\).*v00000009: export folder not found"):
        s.load(9)
    path = ex.export_weights(params, CFG, str(root / "exports"), 3)
    with open(os.path.join(path, "meta.json"), "w") as fh:
        fh.write("{garbled")
    with pytest.raises(SamplerError, match="still serving 2\\).*meta.json: malformed"):
        s.load(3)
    wrong = dataclasses.replace(CFG, intermediate_size=64)  # a readable export of the wrong shape
    ex.export_weights(init_params(wrong, jax.random.PRNGKey(1)), wrong, str(root / "exports"), 3)
    with pytest.raises(SamplerError, match="still serving 2\\).*does not fit the served model: shape mismatch"):
        s.load(3)
    assert _served(s) == 2
    assert s.generate(PROMPTS, 1, SAMPLING, seed=0).weight_version == 2


def test_stale_server_is_refused_and_reloaded(setup):
    s, params, root = setup
    ex.export_weights(params, CFG, str(root / "exports"), 4)
    s.latest = 4  # the trainer moved on; the server still serves 2 and max_staleness is 0
    r = s.generate(PROMPTS, 1, SAMPLING, seed=0)
    assert r.weight_version == 4


def test_killed_server_is_restarted(setup):
    s, _, _ = setup
    old = s.proc.pid
    os.kill(old, signal.SIGKILL)
    r = s.generate(PROMPTS, 2, SAMPLING, seed=1)
    _check_rollout(r, 6, 8)
    assert s.restarts == 1 and s.proc.pid != old
    assert r.weight_version == 4  # the restarted engine reloaded the latest export
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE


def _sparse_step(params, rng, frac=0.02, lr=1e-3, leaves=None):
    """A small update of a random `frac` of the words (of the named top-level entries only, if given)."""
    out = {}
    for k, v in params.items():
        if leaves is not None and k not in leaves:
            out[k] = v
            continue
        out[k] = jax.tree.map(
            lambda x: (x + lr * rng.standard_normal(x.shape) * (rng.random(x.shape) < frac)).astype(x.dtype), v
        )
    return out


def _same_rollout(a, b):
    return a.tokens == b.tokens and np.array_equal(np.concatenate(a.logprobs), np.concatenate(b.logprobs))


def test_delta_sync_twenty_updates_restart_and_corrupt_delta(setup):
    """20 delta-synced versions, a killed server and a corrupted delta: the engine's weights always equal a full
    export of the same version (same hashes on the server; bit-identical samples and log-probs after a full
    reload of the same version)."""
    s, params, root = setup
    rng = np.random.default_rng(0)
    s.publisher.full_every = 8
    s.update_weights(params, 9)  # earlier tests left the server on a version this publisher did not write
    assert s.last_load["version"] == 9
    p, kinds = params, []
    leaves = len(jax.tree.leaves(params))

    def check_exact(version):
        served = s.generate(PROMPTS, 4, SAMPLING, seed=version)
        s.publisher.publish_full()  # the same version, whole, loaded afresh
        s.load(version)
        assert _same_rollout(s.generate(PROMPTS, 4, SAMPLING, seed=version), served), version

    restarts, resends = s.restarts, s.full_resends
    for v in range(10, 30):
        p = _sparse_step(p, rng)
        if v == 19:
            os.kill(s.proc.pid, signal.SIGKILL)  # the next update finds the server dead: restart, no base for a delta
        s.update_weights(p, v)
        kinds.append(s.last_publish.kind)
        assert s.last_load["version"] == v and s.last_load["hashes"] == s.publisher.hashes
        # a delta is written into the engine's tensors (v19: the restarted server had no base and got it whole)
        assert s.last_load["inplace"] == (s.last_publish.kind == "delta" and v != 19)
        want = [np.asarray(x, np.float32).view(np.uint32).ravel() for x in jax.tree.leaves(p)]
        assert all(np.array_equal(a.view(np.uint32).ravel(), b) for a, b in zip(s.publisher.published(), want))
        if v in (14, 22):
            check_exact(v)
    assert s.restarts == restarts + 1 and s.full_resends == resends + 1  # v19: restarted, then sent whole
    assert kinds.count("delta") >= 15 and kinds[0] == "delta", kinds
    # a version that changes one tensor reloads one tensor
    s.publisher.full_every = 100
    p = _sparse_step(p, rng, frac=0.5, leaves={"final_norm"})
    s.update_weights(p, 30)
    assert s.last_publish.kind == "delta" and s.last_load["tensors"] == 1
    # a corrupted delta on disk (readable, one word flipped) is refused by the hash check and sent again whole
    p = _sparse_step(p, rng)
    s.publisher.publish(p, 31)
    path = ex.version_dir(s.export_root, 31)
    meta = ex.read_meta(path)
    _, payload = ex.load_export(path, allow_delta=True)
    payload["val"][0] ^= np.uint32(1 << 20)
    ex.export_weights(payload, CFG, s.export_root, 31, meta={k: meta[k] for k in meta if k != "version"})
    s.latest = 31
    assert s.load(31) == 31 and s.full_resends == resends + 2
    assert s.last_load["hashes"] == s.publisher.hashes and len(s.last_load["hashes"]) == leaves
    check_exact(31)


def test_the_real_server_refuses_serves_and_reports_a_stuck_load(setup):
    """401/413/400 where due and a good greedy generate; a load blocked on its file system makes /health 503 after
    the stall limit while a second, concurrent load waits for it (loads are serialised)."""
    s, params, root = setup
    port, token = s.address[1], s._token
    auth = {"Authorization": f"Bearer {token}"}
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    s.update_weights(params, 1)  # served: v1 = the start weights (a step back from the last test's v31: written whole)
    ref = s.generate([[5, 6, 7], [9]], 1, greedy, seed=0)
    by_hand = {"prompts": [[5, 6, 7], [9]], "n": 1, "max_new_tokens": 8, "temperature": 0.0, "seed": 0}
    status, body = post(port, "/generate", by_hand, token=token, timeout=60)
    assert status == 200 and [r["tokens"] for r in body["rows"]] == ref.tokens
    assert post(port, "/generate", by_hand, token=None)[0] == 401
    assert post(port, "/generate", by_hand, token=token[:-1])[0] == 401
    assert call(port, "POST", "/generate", {**auth, "Content-Length": "-1"})[0] == 400
    assert call(port, "POST", "/generate", {**auth, "Content-Length": str(s.limits.generate_cap() + 1)})[0] == 413
    n = s.limits.n + 1
    status, body = post(port, "/generate", {**by_hand, "n": n}, token=token)
    assert status == 400 and f"n={n} is outside [1, {s.limits.n}]" in body["error"]

    stuck = root / "exports" / "v00000002"
    stuck.mkdir()
    os.mkfifo(stuck / "meta.json")  # a read that blocks until someone writes: a hung file system
    answers = {}

    def load(v):
        answers[v] = post(port, "/load", {"version": v}, token=token, timeout=120)

    first = threading.Thread(target=load, args=(2,))
    first.start()
    time.sleep(0.5)
    second = threading.Thread(target=load, args=(1,))
    second.start()
    deadline = time.monotonic() + 20
    while (health := call(port, "GET", "/health", auth))[0] == 200:
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert health[0] == 503 and "2 load request(s) in flight" in health[1]["stuck"], health
    assert second.is_alive() and 1 not in answers  # the second load waits for the first
    with open(stuck / "meta.json", "w") as fh:
        fh.write("{garbled")
    first.join(60)
    second.join(60)
    assert answers[2][0] == 422 and "meta.json: malformed" in answers[2][1]["error"]
    assert answers[1][0] == 200 and answers[1][1]["version"] == 1
    assert call(port, "GET", "/health", auth) == (200, {"ok": True, "version": 1})
    assert s.generate([[5, 6, 7], [9]], 1, greedy, seed=0).tokens == ref.tokens  # v1 again, intact
    with open(f"/proc/{s.proc.pid}/cmdline", "rb") as fh:
        assert token.encode() not in fh.read()


def test_port_in_use_names_the_port(setup):
    _, _, root = setup
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "twocircuit_jax.sampler.vllm_server",
                "--model-dir",
                str(root / "model"),
                "--export-root",
                str(root / "exports"),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2
        assert f"port {port} is already in use" in out.stderr
        with pytest.raises(SamplerError, match=f"port {port} is already in use"):
            VLLMSampler(
                SamplerConfig(port=port, startup_timeout_s=60), str(root / "model"), str(root / "exports2"), CFG
            )


def test_close_leaves_no_orphan(setup):
    s, _, root = setup
    leader = psutil.Process(s.proc.pid)
    family = [leader.pid] + [c.pid for c in leader.children(recursive=True)]
    s.close()
    s.close()  # idempotent
    for pid in family:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in family]
    no_file_holds(root, s._token)  # the server's secret: in its environment only, in no file of the module

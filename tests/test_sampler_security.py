"""The sampler serves only its trainer (docs/reliability.md, sampler threat model).

The fast tests run the server's real HTTP layer (vllm_server._server/_handler with sampler/http_guard.py) over an
engine that counts the requests reaching it and answers none of them: every request here is refused before the
engine. The real vLLM server's refusals, a good generate, /health during a stuck load and two concurrent loads are
checked in tests/test_vllm_sampler.py::test_the_real_server_refuses_serves_and_reports_a_stuck_load, on that
module's server (one engine start fewer).
"""

import http.client
import json
import os
import sys
import textwrap
import threading
import time

import pytest

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.config.run import load_config
from twocircuit_jax.config.sections import ModelConfig, SamplerConfig, SamplingConfig
from twocircuit_jax.sampler import http_guard as hg, vllm_server as vs
from twocircuit_jax.sampler.vllm_client import SamplerError, VLLMSampler

LIMITS = hg.Limits(n=4, max_new_tokens=8, prompts=3, prompt_len=16)
TOKEN = "s3cret-token"


class Unreached:
    """Stands where the engine is; no request in these tests may get here."""

    version, healthy, vocab = 0, True, 96

    def __init__(self):
        self.reached = 0

    def generate(self, req):
        self.reached += 1
        raise RuntimeError("the engine was reached")

    load = generate


@pytest.fixture
def server():
    engine = Unreached()
    guard = hg.Guard(TOKEN, LIMITS, stall_s=60, socket_timeout_s=0.5)
    httpd = vs._server(("127.0.0.1", 0), guard)
    httpd.RequestHandlerClass = vs._handler(engine, guard)
    t = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    t.start()
    yield httpd.server_address[1], engine, guard
    httpd.shutdown()
    httpd.server_close()


def call(port, method, path, headers, body=b"", send=None, timeout=10):
    """(status, json body). `headers` are sent as given (no Content-Length added); `send`: bytes actually sent."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        conn.send(body if send is None else send)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def post(port, path, payload, token=TOKEN, timeout=10):
    body = json.dumps(payload).encode()
    h = {"Content-Length": str(len(body))}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    return call(port, "POST", path, h, body, timeout=timeout)


GOOD = {"prompts": [[5, 6, 7]], "n": 2, "max_new_tokens": 8, "seed": 1}


def test_requests_are_refused_before_the_engine(server):
    port, engine, guard = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert call(port, "GET", "/health", {})[0] == 401
    assert call(port, "GET", "/health", {"Authorization": "Bearer wrong"})[0] == 401
    assert call(port, "GET", "/health", auth) == (200, {"ok": True, "version": 0})
    assert post(port, "/generate", GOOD, token=None)[0] == 401
    assert post(port, "/load", {"version": 1}, token="s3cret-tokeN")[0] == 401
    assert post(port, "/generate", GOOD, token=TOKEN + "x")[0] == 401
    # lengths: missing, negative, not an integer -> 400; over the cap -> 413, answered without reading the body
    # (the server's socket timeout is 0.5 s, the client's 10 s: a server waiting for the body would answer 408)
    assert call(port, "POST", "/generate", auth)[0] == 400
    for bad in ("-5", "abc", "1e3", "+7", ""):
        status, body = call(port, "POST", "/generate", {**auth, "Content-Length": bad})
        assert status == 400 and "Content-Length" in body["error"], bad
    assert call(port, "POST", "/generate", {**auth, "Content-Length": "5", "Transfer-Encoding": "chunked"})[0] == 400
    cap = LIMITS.generate_cap()
    t0 = time.monotonic()
    status, body = call(port, "POST", "/generate", {**auth, "Content-Length": str(cap + 1)})
    assert status == 413 and str(cap) in body["error"] and time.monotonic() - t0 < 0.4
    assert call(port, "POST", "/load", {**auth, "Content-Length": str(hg.LOAD_CAP + 1)})[0] == 413
    assert call(port, "POST", "/load", {**auth, "Content-Length": "9" * 40})[0] == 413
    # bounds: each names the field and the limit
    for change, field, limit in (
        ({"n": 5}, "n=5", "4"),
        ({"max_new_tokens": 9}, "max_new_tokens=9", "8"),
        ({"prompts": [[1]] * 4}, "prompts=4", "3"),
        ({"prompts": [[1] * 17]}, "len(prompts[0])=17", "16"),
        ({"n": 0}, "n=0", "1"),
    ):
        status, body = post(port, "/generate", {**GOOD, **change})
        assert status == 400 and field in body["error"] and limit in body["error"], (change, body)
    for change in ({"prompts": [[1, 96]]}, {"prompts": [[1, -1]]}, {"prompts": [["1"]]}, {"n": 2.0}, {"seed": "x"}):
        assert post(port, "/generate", {**GOOD, **change})[0] == 400, change
    assert post(port, "/generate", [1, 2])[0] == 400
    assert post(port, "/load", {"version": "7"})[0] == 400
    assert call(port, "POST", "/generate", {**auth, "Content-Length": "3"}, b"{x}")[0] == 400
    assert engine.reached == 0
    # a request that passes every check does reach the engine (which refuses to answer here)
    assert post(port, "/generate", GOOD)[0] == 500 and engine.reached == 1


def test_a_half_sent_body_times_out_and_the_server_keeps_serving(server):
    port, engine, guard = server
    h = {"Authorization": f"Bearer {TOKEN}", "Content-Length": "100"}
    t0 = time.monotonic()
    status, body = call(port, "POST", "/generate", h, send=b'{"prompts": ')
    assert status == 408 and time.monotonic() - t0 < 5
    assert call(port, "GET", "/health", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert engine.reached == 0


def test_watch_reports_an_engine_that_stops_answering():
    now = [0.0]
    w = hg.Watch(10.0, clock=lambda: now[0])
    assert w.stuck() == ""
    with w.busy("generate"):
        with w.busy("generate"):  # queued behind the first
            now[0] = 9.0
            assert w.stuck() == ""
        now[0] = 18.0  # one answered at t=9: the engine progresses, the other has waited 9 s since
        assert w.stuck() == ""
        now[0] = 19.5
        assert "1 generate request(s) in flight and none answered for 10.5 s (stall limit 10 s)" == w.stuck()
        with w.busy("load"):  # a new kind starts fresh but the stuck generate still counts
            assert "generate" in w.stuck()
    assert w.stuck() == ""  # everything answered
    assert hg.Watch(0.0, clock=lambda: now[0]).stuck() == ""


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "myhost"])
def test_a_non_loopback_host_needs_allow_remote(host):
    with pytest.raises(ConfigError, match=rf"sampler\.host: got '{host}', not a loopback.*sampler\.allow_remote"):
        load_config(data={"sampler": {"host": host}})
    assert load_config(data={"sampler": {"host": host, "allow_remote": True}}).sampler.host == host
    for loop in ("127.0.0.1", "127.0.0.5", "::1", "localhost"):
        assert load_config(data={"sampler": {"host": loop}}).sampler.host == loop


# The fake server imports the sampler modules without the package's __init__ (jax and the model: ~1.5 s of CPU, for
# APIs it never calls), as tests/test_vllm_client_faults.py's fakes do; vllm_server and http_guard are imported as is.
FAKE = textwrap.dedent("""
    import importlib.util, sys, types
    _spec = importlib.util.find_spec("twocircuit_jax")
    _pkg = types.ModuleType("twocircuit_jax")
    _pkg.__path__ = list(_spec.submodule_search_locations)
    sys.modules["twocircuit_jax"] = _pkg
    from twocircuit_jax.sampler import http_guard as hg, vllm_server as vs

    class Unreached:
        version, healthy, vocab = 0, True, 96

        def generate(self, req):
            raise RuntimeError("the engine was reached")

        load = generate

    args = vs.parse_args()
    guard = vs.guard_from_args(args, hg.Guard.from_env().token)
    httpd = vs._server((args.host, args.port), guard)
    httpd.RequestHandlerClass = vs._handler(Unreached(), guard)
    print("READY %s:%d" % httpd.server_address[:2], flush=True)
    httpd.serve_forever(poll_interval=0.1)
""")


def test_the_client_sends_its_secret_and_limits_and_never_writes_them(tmp_path):
    """The trainer's side: the secret reaches the server through its environment only, every request carries it,
    and the limits given to the client are the server's."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    (tmp_path / "model").mkdir()
    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=2, head_dim=16, intermediate_size=48)
    s = VLLMSampler(
        SamplerConfig(startup_timeout_s=30, request_timeout_s=10, max_retries=0),
        str(tmp_path / "model"),
        str(tmp_path / "run"),
        cfg,
        command=[sys.executable, str(script)],
        limits=LIMITS,
    )
    try:  # start-up's /health answered 200: the secret went through
        with open(f"/proc/{s.proc.pid}/cmdline", "rb") as fh:
            assert s._token.encode() not in fh.read()
        assert hg.TOKEN_ENV not in os.environ
        assert post(s.address[1], "/load", {"version": 1}, token=None)[0] == 401
        with pytest.raises(SamplerError, match=r"HTTP 400.*n=5 is outside \[1, 4\]"):
            s.generate([[1, 2]], 5, SamplingConfig(max_new_tokens=8), seed=0)
        with pytest.raises(SamplerError, match=r"HTTP 400.*max_new_tokens=9 is outside \[1, 8\]"):
            s.generate([[1, 2]], 1, SamplingConfig(max_new_tokens=9), seed=0)
    finally:
        s.close()
    no_file_holds(tmp_path, s._token)


def no_file_holds(root, secret: str):
    for d, _, files in os.walk(root):
        for f in files:
            if not os.path.islink(os.path.join(d, f)) and os.path.isfile(os.path.join(d, f)):
                with open(os.path.join(d, f), "rb") as fh:
                    assert secret.encode() not in fh.read(), os.path.join(d, f)

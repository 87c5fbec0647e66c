"""What the sampler server checks before a request reaches the engine (threat model: docs/reliability.md).

The server answers only its trainer: every request carries the per-run secret the trainer generated and passed
through the environment (`TOKEN_ENV`), compared in constant time (401 without it). A body is read only when its
`Content-Length` is a non-negative integer (400) within a cap derived from the limits (413), and a /generate body
is held to the trainer's own bounds (`Limits`: 400 naming the field and the limit). `Watch` tells /health when the
engine has stopped answering. Standard library only: the HTTP layer is tested without vLLM.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import secrets
import threading
import time
from contextlib import contextmanager
from typing import NamedTuple

TOKEN_ENV = "TWOCIRCUIT_SAMPLER_TOKEN"  # the per-run secret; the server removes it from its environment at start
LOAD_CAP = 4096  # bytes of a /load body: {"version": v}


class Refusal(ValueError):
    """A request answered with `status` before the engine sees it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Limits(NamedTuple):
    """Per-request bounds of /generate: the trainer's own (limits_for_run), passed at server start."""

    n: int = 64  # samples per prompt
    max_new_tokens: int = 4096  # generated tokens per sample
    prompts: int = 1024  # prompts per request
    prompt_len: int = 8192  # tokens per prompt

    def generate_cap(self) -> int:
        """Bytes of the largest valid /generate body: each token id at most 6 digits and a ", " (vocabularies
        below 10^6), plus 4 KiB for the other fields and 12 bytes per prompt for a fleet's per-prompt seeds (10
        digits and a ", "). 16 MiB at the defaults; 20 KiB for the demo's run."""
        return 4096 + self.prompts * (8 * self.prompt_len + 16)


def limits_for_run(run_cfg) -> Limits:
    """The largest requests a trainer of `run_cfg` sends: a GRPO step (train.prompts_per_step prompts, sampler.n each), a
    multi-turn environment's turn (prompts_per_step * n prompts, n = 1) and a held-out evaluation (up to 64 prompts per
    call, or every eval problem at once in an environment), all at sampling.max_new_tokens and prompts of at most
    train.max_prompt_len tokens."""
    t, s = run_cfg.train, run_cfg.sampler
    return Limits(
        n=s.n,
        max_new_tokens=s.sampling.max_new_tokens,
        prompts=max(t.prompts_per_step * s.n, t.eval_size, 64),
        prompt_len=t.max_prompt_len,
    )


def server_args(limits: Limits, stall_s: float) -> list[str]:
    """The server arguments of `limits` and the /health stall limit."""
    return [
        "--max-n",
        str(limits.n),
        "--max-new-tokens",
        str(limits.max_new_tokens),
        "--max-prompts",
        str(limits.prompts),
        "--max-prompt-len",
        str(limits.prompt_len),
        "--stall-s",
        str(stall_s),
    ]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; any other name or address may be reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorized(header: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time (no timing leak of a prefix)."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())


def body_length(headers, cap: int) -> int:
    """The body's length from `Content-Length`; Refusal 400 if missing, not a plain non-negative integer, or with a
    Transfer-Encoding (a second framing that proxies and this server could read differently); 413 above `cap`."""
    if headers.get("Transfer-Encoding") is not None:
        raise Refusal(400, "Transfer-Encoding is not accepted; send a Content-Length")
    raw = headers.get_all("Content-Length") or []
    if len(raw) != 1:
        raise Refusal(400, "exactly one Content-Length header is required")
    text = raw[0].strip()
    if not (text.isascii() and text.isdigit()):  # refuses "-5", "+5", "1e3", "0x10", "", "²"
        raise Refusal(400, f"Content-Length must be a non-negative integer, got {text[:32]!r}")
    if len(text) > 18:  # over any cap; and no parse of a huge integer
        raise Refusal(413, f"Content-Length of {len(text)} digits is over this endpoint's cap of {cap} bytes")
    n = int(text)
    if n > cap:
        raise Refusal(413, f"body of {n} bytes is over this endpoint's cap of {cap} bytes")
    return n


def _int(body: dict, key: str, default=None) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise Refusal(400, f"{key} must be an integer, got {v!r}"[:200])
    return v


def _num(body: dict, key: str, default: float) -> float:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise Refusal(400, f"{key} must be a finite number, got {v!r}"[:200])
    return float(v)


def _bounded(key: str, v: int, lo: int, hi: int) -> int:
    if not lo <= v <= hi:
        raise Refusal(400, f"{key}={v} is outside [{lo}, {hi}] (this server's limit for {key})")
    return v


def check_generate(body, limits: Limits, vocab: int | None = None) -> dict:
    """The /generate body with every field type- and bound-checked (Refusal 400 naming the field and the limit)."""
    if not isinstance(body, dict):
        raise Refusal(400, "the body must be a JSON object")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise Refusal(400, "prompts must be a non-empty list of token-id lists")
    _bounded("prompts", len(prompts), 1, limits.prompts)
    top = vocab if vocab else 2**31
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise Refusal(400, f"prompts[{i}] must be a non-empty list of token ids")
        _bounded(f"len(prompts[{i}])", len(p), 1, limits.prompt_len)
        if not all(type(t) is int and 0 <= t < top for t in p):
            raise Refusal(400, f"prompts[{i}] must hold integer token ids in [0, {top})")
    seed = body.get("seed")
    if seed is not None:
        _int(body, "seed")
    seeds = body.get("seeds")
    if seeds is not None and (
        not isinstance(seeds, list)
        or len(seeds) != len(prompts)
        or not all(type(x) is int and 0 <= x < 2**31 for x in seeds)
    ):
        raise Refusal(400, f"seeds must be a list of {len(prompts)} integers in [0, 2^31), one per prompt")
    return {
        "prompts": prompts,
        "n": _bounded("n", _int(body, "n", 1), 1, limits.n),
        "max_new_tokens": _bounded("max_new_tokens", _int(body, "max_new_tokens"), 1, limits.max_new_tokens),
        "temperature": _num(body, "temperature", 1.0),
        "top_p": _num(body, "top_p", 1.0),
        "top_k": _int(body, "top_k", 0),
        "seed": seed,
        "seeds": seeds,
        "min_version": _int(body, "min_version", -1),
    }


def check_load(body) -> dict:
    if not isinstance(body, dict):
        raise Refusal(400, "the body must be a JSON object")
    return {"version": _bounded("version", _int(body, "version"), 0, 10**9)}


class Guard(NamedTuple):
    """The server's request policy: the secret, the bounds, the stall limit of /health and the socket timeout."""

    token: str
    limits: Limits = Limits()
    stall_s: float = 600.0  # /health reports stuck after this long with requests in flight and none answered
    socket_timeout_s: float = 30.0  # a connection that sends nothing for this long is closed
    max_connections: int = 64  # open connections; more are closed at once

    @staticmethod
    def from_env(**kw) -> Guard:
        """A guard whose secret is taken out of this process's environment (children never see it)."""
        token = os.environ.pop(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: the sampler answers only requests that carry this secret")
        return Guard(token, **kw)

    def cap(self, path: str) -> int:
        return self.limits.generate_cap() if path == "/generate" else LOAD_CAP


class Watch:
    """Engine progress per kind of request ("generate", "load"). A kind is stuck when it has had requests in
    flight for `stall_s` with none of them answered: requests queued behind a slow but working engine keep
    answering one by one, so a queue is not a stall; a wedged engine (or a load blocked on its file system) is."""

    def __init__(self, stall_s: float, clock=time.monotonic):
        self.stall_s, self.clock = stall_s, clock
        self._lock = threading.Lock()
        self._state: dict[str, list] = {}  # kind -> [requests in flight, time of the last start-from-idle/answer]

    @contextmanager
    def busy(self, kind: str):
        with self._lock:
            st = self._state.setdefault(kind, [0, 0.0])
            if st[0] == 0:
                st[1] = self.clock()
            st[0] += 1
        try:
            yield
        finally:
            with self._lock:
                st[0] -= 1
                st[1] = self.clock()  # an answer (or an error) came back: the engine moves

    def stuck(self) -> str:
        """'' while every kind progresses; else what is stuck and for how long."""
        now = self.clock()
        with self._lock:
            for kind, (inflight, since) in sorted(self._state.items()):
                if inflight and self.stall_s > 0 and now - since > self.stall_s:
                    return (
                        f"{inflight} {kind} request(s) in flight and none answered for {now - since:.1f} s "
                        f"(stall limit {self.stall_s:g} s)"
                    )
        return ""

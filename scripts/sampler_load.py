"""Load and abuse test of the vLLM sampler server: N concurrent clients on the loopback for T seconds.

    python scripts/sampler_load.py --clients 4 --seconds 45

Starts the server the way the trainer does (VLLMSampler: per-run secret, the limits of a small run config) over a
tiny model exported here, computes a reference greedy answer for each of two weight versions, then lets every
client loop over a random mix of good /generate and /load requests and malformed ones (no or a wrong secret, bad
Content-Length, an oversized body, a half-sent body, out-of-bound n / max_new_tokens / prompts / prompt length).
A good generate is correct when its tokens equal the reference of the version it reports; a load when it answers
the version asked for; a malformed request when it gets its refusal (401, 400, 413 or 408). Prints requests served,
p50/p99 latency by kind, answers by kind and status, then checks the server still serves. Exit 1 on any lost
(transport error) or wrong answer. Needs vLLM (the test extras).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14], [20, 21]]  # every good generate sends these: one batch shape


def bounded(lo, hi):
    def parse(text):
        v = int(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside [{lo}, {hi}]")
        return v

    return parse


class Client:
    def __init__(self, port: int, token: str, limits, cap: int, socket_timeout_s: float):
        self.port, self.token, self.limits, self.cap = port, token, limits, cap
        self.socket_timeout_s = socket_timeout_s

    def raw(self, method, path, headers, body=b"", send=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
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

    def post(self, path, payload, token="own"):
        body = json.dumps(payload).encode()
        h = {"Content-Length": str(len(body))}
        if token is not None:
            h["Authorization"] = f"Bearer {self.token if token == 'own' else token}"
        return self.raw("POST", path, h, body)

    def good_generate(self):
        return self.post("/generate", generate_body())

    # each malformed request: (kind, expected status, function)
    def malformed(self):
        auth = {"Authorization": f"Bearer {self.token}"}
        L = self.limits
        return [
            ("no_token", 401, lambda: self.post("/generate", generate_body(), token=None)),
            ("wrong_token", 401, lambda: self.post("/generate", generate_body(), token=self.token[::-1])),
            ("negative_length", 400, lambda: self.raw("POST", "/generate", {**auth, "Content-Length": "-20"})),
            ("missing_length", 400, lambda: self.raw("POST", "/load", auth)),
            ("non_integer_length", 400, lambda: self.raw("POST", "/generate", {**auth, "Content-Length": "4e2"})),
            ("oversized", 413, lambda: self.raw("POST", "/generate", {**auth, "Content-Length": str(self.cap + 1)})),
            ("n_over", 400, lambda: self.post("/generate", generate_body(n=L.n + 1))),
            ("max_new_over", 400, lambda: self.post("/generate", generate_body(max_new_tokens=L.max_new_tokens + 1))),
            ("prompts_over", 400, lambda: self.post("/generate", generate_body(prompts=[[5]] * (L.prompts + 1)))),
            ("prompt_len_over", 400, lambda: self.post("/generate", generate_body(prompts=[[5] * (L.prompt_len + 1)]))),
            ("bad_json", 400, lambda: self.raw("POST", "/generate", {**auth, "Content-Length": "5"}, b"{nope")),
            (
                "half_body",
                408,
                lambda: self.raw("POST", "/generate", {**auth, "Content-Length": "200"}, send=b'{"prompts": [[5'),
            ),
        ]


def generate_body(**change):
    return {"prompts": PROMPTS, "n": 1, "max_new_tokens": 8, "temperature": 0.0, "seed": 0, **change}


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=bounded(1, 64), default=4, help="concurrent clients, 1..64")
    ap.add_argument("--seconds", type=bounded(1, 600), default=45, help="duration, 1..600 s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.config.sections import ModelConfig
    from twocircuit_jax.model import init_params, save_hf
    from twocircuit_jax.sampler import export as ex
    from twocircuit_jax.sampler.http_guard import limits_for_run
    from twocircuit_jax.sampler.vllm_client import VLLMSampler

    # the vLLM CPU build's smallest servable shapes (head_dim >= 32), as in tests/hf_models.py TINY_VLLM
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_embeddings=False,
        eos_token_id=2,
    )
    run_cfg = load_config(
        data={
            "sampler": {"backend": "vllm", "n": 2, "sampling": {"max_new_tokens": 8}, "stall_timeout_s": 60},
            "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 16, "eval_size": 8},
        }
    )
    limits = limits_for_run(run_cfg)
    socket_timeout_s = 2.0
    root = tempfile.mkdtemp(prefix="sampler-load-")
    versions = {
        v: jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(v), std=0.3)) for v in (1, 2)
    }  # two different policies: an answer from the wrong one shows
    save_hf(cfg, versions[1], os.path.join(root, "model"))
    for v, p in versions.items():
        ex.export_weights(p, cfg, os.path.join(root, "exports"), v)
    t0 = time.monotonic()
    s = VLLMSampler(
        run_cfg.sampler,
        os.path.join(root, "model"),
        os.path.join(root, "exports"),
        cfg,
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_model_len=limits.prompt_len + limits.max_new_tokens,
        limits=limits,
        socket_timeout_s=socket_timeout_s,
    )
    print(f"server up in {time.monotonic() - t0:.0f} s at {s.address[0]}:{s.address[1]}; limits {limits}")
    try:
        return run(s, args, limits, socket_timeout_s)
    finally:
        s.close()


def run(s, args, limits, socket_timeout_s) -> int:
    c0 = Client(s.address[1], s._token, limits, limits.generate_cap(), socket_timeout_s)
    ref = {}
    for v in (2, 1):  # ends on 1
        status, body = c0.post("/load", {"version": v})
        assert status == 200 and body["version"] == v, (status, body)
        status, body = c0.good_generate()
        assert status == 200 and body["version"] == v, (status, body)
        ref[v] = [r["tokens"] for r in body["rows"]]
    if ref[1] == ref[2]:
        print("error: the two versions give the same greedy answer; the check could not tell them apart")
        return 1
    print(f"reference greedy answers computed for versions 1 and 2 ({len(PROMPTS)} prompts, 8 tokens)")

    lock = threading.Lock()
    latency = collections.defaultdict(list)  # kind -> seconds
    outcome = collections.Counter()  # (kind, status or 'lost'/'wrong')
    problems = []
    stop = time.monotonic() + args.seconds

    def worker(i):
        rng = random.Random(args.seed * 1000 + i)
        c = Client(s.address[1], s._token, limits, limits.generate_cap(), socket_timeout_s)
        bad = c.malformed()
        while time.monotonic() < stop:
            r = rng.random()
            if r < 0.5:
                kind, expect, fn = "generate", 200, c.good_generate
            elif r < 0.6:
                v = rng.choice((1, 2))
                kind, expect, fn = f"load_v{v}", 200, lambda v=v: c.post("/load", {"version": v})
            else:
                kind, expect, fn = rng.choice(bad if rng.random() < 0.1 else bad[:-1])  # half bodies wait 2 s
            t = time.monotonic()
            try:
                status, body = fn()
            except (OSError, http.client.HTTPException, ValueError) as e:
                status, body, why = "lost", None, f"{type(e).__name__}: {e}"
            else:
                why = ""
                if status != expect:
                    why = f"HTTP {status} (expected {expect}): {body}"
                elif kind == "generate" and [x["tokens"] for x in body["rows"]] != ref.get(body["version"]):
                    why = f"tokens differ from version {body['version']}'s reference"
                elif kind.startswith("load_v") and body["version"] != int(kind[6:]):
                    why = f"answered version {body['version']}"
                if why and status != "lost":
                    status = "wrong"
            with lock:
                latency[kind].append(time.monotonic() - t)
                outcome[(kind, status)] += 1
                if why:
                    problems.append(f"{kind}: {why}"[:300])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    served = sum(n for (k, st), n in outcome.items() if st not in ("lost",))
    print(f"\n{args.clients} clients, {wall:.1f} s: {served} requests answered ({served / wall:.1f}/s)")
    print(f"{'kind':<20}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}  answers")
    for kind in sorted(latency):
        xs = latency[kind]
        answers = ", ".join(f"{st}: {n}" for (k, st), n in sorted(outcome.items(), key=str) if k == kind)
        print(f"{kind:<20}{len(xs):>7}{1e3 * percentile(xs, 50):>10.1f}{1e3 * percentile(xs, 99):>10.1f}  {answers}")
    lost = sum(n for (k, st), n in outcome.items() if st == "lost")
    wrong = sum(n for (k, st), n in outcome.items() if st == "wrong")
    # after everything: the server still serves, and correctly
    status, body = c0.raw("GET", "/health", {"Authorization": f"Bearer {s._token}"})
    health_ok = status == 200 and body.get("ok")
    status, body = c0.good_generate()
    after_ok = status == 200 and [x["tokens"] for x in body["rows"]] == ref.get(body.get("version"))
    print(
        f"lost: {lost}, wrong: {wrong}; afterwards /health {'ok' if health_ok else 'NOT ok'}, "
        f"a good generate {'correct' if after_ok else 'NOT correct'}"
    )
    for p in problems[:10]:
        print("  " + p)
    return 0 if not (lost or wrong) and health_ok and after_ok else 1


if __name__ == "__main__":
    sys.exit(main())

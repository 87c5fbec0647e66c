"""Building the pieces of a run from its config: tokenizer, model weights, mesh, sampler."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.model.hf_io import CheckpointError, load_hf
from twocircuit_jax.model.qwen2 import dtype_of, init_params
from twocircuit_jax.model.tokenizer import load_tokenizer


def check_local_paths(run_cfg) -> None:
    """Before any heavy work: the local folders and files the run reads exist (base_model, a tokenizer folder, the
    task's train/eval files). The first one missing is one ConfigError naming its field and path (exit 2)."""
    if run_cfg.base_model and not os.path.isdir(os.path.expanduser(run_cfg.base_model)):
        raise ConfigError(
            "base_model", f"got {run_cfg.base_model!r}; directory not found (a local Hugging Face or native checkpoint)"
        )
    tok = run_cfg.tokenizer
    if tok not in ("", "auto", "char") and not os.path.isdir(os.path.expanduser(tok)):
        raise ConfigError("tokenizer", f"got {tok!r}; directory not found (a local Hugging Face tokenizer folder)")
    for key in ("train_files", "eval_files"):
        for path in getattr(run_cfg.task, key, ()) or ():
            if not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"task.{key}", f"got {path!r}; file not found (local .jsonl or .parquet files)")


def load_model(run_cfg, seed: int):
    """(ModelConfig, params) from `base_model`: a Hugging Face dir (config.json), a native export/import dir
    (meta.json + params/), or '' for random init from `model:`."""
    path = run_cfg.base_model
    if not path:
        cfg = run_cfg.model
        return cfg, init_params(cfg, jax.random.key(seed))
    if not os.path.isdir(path):
        raise ConfigError("base_model", f"got {path!r}; directory not found")
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            cfg, params = load_hf(path)
        except CheckpointError as e:
            raise ConfigError("base_model", str(e)) from None
    else:
        from twocircuit_jax.config.base import from_dict
        from twocircuit_jax.config.sections import ModelConfig
        from twocircuit_jax.sampler.export import ExportError, load_export

        try:
            mcfg, params = load_export(path)
        except ExportError as e:
            raise ConfigError(
                "base_model", f"{path}: neither a Hugging Face dir (no config.json) nor a native checkpoint ({e})"
            ) from None
        cfg = from_dict(ModelConfig, mcfg)
        params = jax.tree.map(jnp.asarray, params)
    _check_model_section(run_cfg.model, cfg, path)
    # the run's dtypes and forward settings win over the checkpoint's
    cfg = dataclasses.replace(cfg, **{name: getattr(run_cfg.model, name) for name in _RUN_OWNED})
    params = jax.tree.map(lambda a: a.astype(dtype_of(cfg.param_dtype)), params)
    return cfg, params


# What `model:` may still say when `base_model` gives the weights: the dtypes the run computes in and how its
# forward runs (rematerialisation, layer scan, attention kernel, LM-head chunk), none of which a checkpoint's
# weights depend on.
_RUN_OWNED = ("param_dtype", "compute_dtype", "remat", "scan_layers", "attention", "attention_block", "logits_chunk")


def _check_model_section(section, loaded, path: str) -> None:
    """With `base_model`, the checkpoint decides the model's shape and ids: a `model.*` value other than its default
    must equal the checkpoint's, or it would be silently ignored."""
    default = type(section)()
    for f in dataclasses.fields(section):
        mine = getattr(section, f.name)
        if f.name in _RUN_OWNED or mine == getattr(default, f.name) or mine == getattr(loaded, f.name):
            continue
        raise ConfigError(
            f"model.{f.name}",
            f"got {mine!r}; the checkpoint base_model={path} has {getattr(loaded, f.name)!r}. With base_model the "
            f"checkpoint gives the model (only model.{', model.'.join(_RUN_OWNED)} apply): leave model."
            f"{f.name} out or set it to the checkpoint's value",
        )


def load_run_tokenizer(run_cfg):
    spec = run_cfg.tokenizer
    if spec in ("", "auto"):
        spec = run_cfg.base_model
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as e:
        raise ConfigError("tokenizer", str(e)) from None


def check_vocab(model_cfg, tokenizer):
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            "model.vocab_size", f"got {model_cfg.vocab_size}; the tokenizer has {tokenizer.vocab_size} tokens"
        )
    # One end-of-sequence id: the sampler stops at the model's, the decoder cuts the text at the tokenizer's. They
    # must be the same token; which one is right only the user knows, so a disagreement is an error.
    if model_cfg.eos_token_id != tokenizer.eos_id:
        raise ConfigError(
            "model.eos_token_id",
            f"got {model_cfg.eos_token_id}; the tokenizer ({tokenizer.spec}) ends sequences with token "
            f"{tokenizer.eos_id}. Set model.eos_token_id: {tokenizer.eos_id} (with base_model: the checkpoint's "
            "config.json eos_token_id), or use the tokenizer the model was trained with",
        )
    return model_cfg


def enable_compile_cache(path: str) -> str:
    """Turn on JAX's persistent compilation cache at `path` (train.compile_cache) unless the process already has one
    (JAX_COMPILATION_CACHE_DIR, or an earlier trainer in this process); returns the folder in use, '' = none.
    Entries are keyed by the program and the compiler flags, so a hit is the program a compile would give. Every
    program is kept however quick its compile (JAX's default keeps those over 1 s only; the first GRPO step is
    several programs of 0.3-4 s each)."""
    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or ""
    from jax.experimental.compilation_cache import compilation_cache

    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides at a process's first compile whether a cache is in use; earlier compiles (model init, user
    # code) would have decided "no": make it decide again.
    compilation_cache.reset_cache()
    return path


def make_sampler(run_cfg, model_cfg, params, tokenizer, run_dir: str):
    """The rollout engine named by `sampler.backend`."""
    if run_cfg.sampler.backend == "jax":
        from twocircuit_jax.sampler.jax_sampler import JaxSampler

        # With async rollouts it generates while the train step donates the weights it was given: it keeps a copy.
        return JaxSampler(
            model_cfg,
            params,
            prompt_bucket=run_cfg.train.max_prompt_len,
            copy_weights=run_cfg.train.async_rollouts > 0,
            max_rows_per_call=run_cfg.sampler.max_rows_per_call,
        )
    if jax.process_count() > 1:
        # An engine per process would export its own copy of the weights and draw other samples (vLLM's sampling
        # is not reproducible across engines): the processes' batches would disagree. Process 0 alone builds the
        # one-process sampler, from the initial weights gathered to it (a collective: every process is here), and
        # every process trains on its rollouts (sampler/process_zero.py).
        from twocircuit_jax.sampler.process_zero import ProcessZeroSampler, gather_to_zero

        host = gather_to_zero(params)
        return ProcessZeroSampler(lambda: _one_process_sampler(run_cfg, model_cfg, host, run_dir))
    return _one_process_sampler(run_cfg, model_cfg, params, run_dir)


def _one_process_sampler(run_cfg, model_cfg, params, run_dir: str):
    """The engine process of `sampler.backend: vllm`, driven from this process."""
    from twocircuit_jax.model.hf_io import save_hf
    from twocircuit_jax.sampler.export import make_shm_root
    from twocircuit_jax.sampler.http_guard import limits_for_run
    from twocircuit_jax.sampler.vllm_client import VLLMSampler, untie_for_vllm

    # The engine starts from a Hugging Face folder of the run's own initial weights (version 0); every update
    # after that arrives as an orbax export under `export_dir` and is reloaded in place.
    sc = run_cfg.sampler
    model_cfg, params = untie_for_vllm(model_cfg, jax.device_get(params), sc.weight_update)
    model_dir = save_hf(model_cfg, params, os.path.join(run_dir, "sampler", "model"), overwrite=True)  # the run's own
    shm = sc.export_dir == "shm"
    if shm and not os.access("/dev/shm", os.W_OK):
        raise ConfigError("sampler.export_dir", "'shm' needs a writable /dev/shm on this host; set a folder instead")
    export_root = (
        make_shm_root("/dev/shm")  # removes the exports dead runs left there
        if shm
        else sc.export_dir or os.path.join(run_dir, "sampler", "exports")
    )
    T = run_cfg.train.max_prompt_len + sc.sampling.max_new_tokens
    kw = dict(
        dtype=run_cfg.model.param_dtype if sc.dtype == "auto" else sc.dtype,
        max_model_len=max(T, 32),
        delta_sync=sc.weight_sync == "delta",
        full_every=sc.full_every,
        remove_exports=shm,
        limits=limits_for_run(run_cfg),  # the server refuses requests larger than this trainer's
    )
    from twocircuit_jax.sampler import placement

    placement.apply(sc)  # the host check; the CLI applied it before JAX started, an API caller may not have
    if sc.engines == 1 and not sc.endpoints:  # one engine: the plain client, as before the fleet
        return VLLMSampler(
            sc, model_dir, export_root, model_cfg, log_path=os.path.join(run_dir, "sampler", "sampler.log"), **kw
        )
    from twocircuit_jax.sampler.fleet import VLLMFleet

    endpoints = [(h, int(p)) for h, _, p in (e.rpartition(":") for e in sc.endpoints)]
    return VLLMFleet(
        sc,
        model_dir,
        export_root,
        model_cfg,
        endpoints=endpoints,
        secret=endpoint_secret(sc) if endpoints else "",
        log_dir=os.path.join(run_dir, "sampler"),
        **kw,
    )


def endpoint_secret(sc) -> str:
    """The secret of the engines at sampler.endpoints: sampler.secret_file's content, else env
    TWOCIRCUIT_SAMPLER_TOKEN; ConfigError when neither holds one (never a secret on a command line or in a config)."""
    from twocircuit_jax.sampler.http_guard import TOKEN_ENV

    if sc.secret_file:
        try:
            with open(sc.secret_file) as fh:
                token = fh.read().strip()
        except OSError as e:
            raise ConfigError("sampler.secret_file", f"{sc.secret_file}: {e.strerror}") from None
        if not token:
            raise ConfigError("sampler.secret_file", f"{sc.secret_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(
            "sampler.secret_file",
            f"sampler.endpoints needs their secret: set sampler.secret_file to a file holding it, or env {TOKEN_ENV}",
        )
    return token

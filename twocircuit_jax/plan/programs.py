"""The programs one GRPO step runs, built from shapes alone, and how often each runs per step.

`programs(cfg, devices, platform)` is step/abstract_step.py `abstract_programs`: the trainer's own programs from
its one builder (step/programs.py), so what the plan compiles is what a run executes: the train step (with the fused
ℓ_old diagnostics, the gradient codec and the anchor's merger when the config has them), the ℓ_old pass and the
diagnostics unless the train forward is the ℓ_old pass, ℓ_ref with a KL term, the probe's passes, the anchor's fire
and its dense ℓ_ref. `usage` says how often each runs in a GRPO step and over how many rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Usage(NamedTuple):
    runs: float  # calls per GRPO step
    rows: int  # sequences per call (global)
    backward: bool  # a gradient is taken (model flops 6N per token, else 2N)


def usage(cfg, names) -> dict:
    """{name: Usage} for the programs `programs` returned."""
    t, s = cfg.train, cfg.sampler
    ticks = cfg.ticks_per_step * t.ppo_epochs
    mini, step = t.prompts_per_update * s.n, t.prompts_per_step * s.n
    fires = ticks / cfg.anchor.cadence if cfg.anchor.enabled else 0.0
    probe = 1 / t.probe_every if t.probe_every else 0.0
    table = {
        "train_step": Usage(ticks, mini, True),
        # the gradient codec's warm-up (its first start_after reduces of a run): it must fit, but a steady step
        # does not run it
        "train_step_warmup": Usage(0, mini, True),
        "logp_old": Usage(1, step, False),
        "diagnostics": Usage(1, 0, False),  # [B, T] scalars only: no model flops
        "logp_ref": Usage(1, step, False),
        "logp_dense": Usage(probe, step, False),
        "probe_sums": Usage(probe, 0, False),
        "fidelity": Usage(probe, mini, True),
        "anchor_fire": Usage(fires, mini, True),
        # the kept mini-batches: one per fire, and the retained one when the delay is not a multiple of the cadence
        "logp_anchor_ref": Usage(fires * (1 if cfg.anchor.delay % cfg.anchor.cadence == 0 else 2), mini, False),
    }
    return {n: table[n] for n in names}


class _Bound(NamedTuple):
    """A program with its static keyword arguments bound, lowered like a jitted function (plan/measure.py)."""

    jitted: Any
    kwargs: dict

    def lower(self, *args):
        return self.jitted.lower(*args, **self.kwargs)

    @property
    def wrapped(self):
        return _Bound(getattr(self.jitted, "wrapped", self.jitted), self.kwargs)


def programs(cfg, devices, platform: str) -> dict:
    """{name: (jitted, args)}: every program one GRPO step of `cfg` runs on `devices`, from shapes alone (the
    trainer's own, step/abstract_step.py). `platform` ("tpu" or "cpu") is what the Pallas kernels are built for."""
    from twocircuit_jax.step.abstract_step import abstract_programs

    progs = abstract_programs(cfg, devices, lowering_platform=platform if platform != "cpu" else None)
    return {n: ((_Bound(p.jitted, p.kwargs) if p.kwargs else p.jitted), p.args) for n, p in progs.items()}


class Generation(NamedTuple):
    """One generation program of a step: the embedded sampler's call (sampler/jax_sampler.py generate_tokens)."""

    program: Any  # _Bound: generate_tokens with its static arguments
    args: tuple  # ShapeDtypeStructs with shardings
    usage: Usage
    prompts: int  # prompts per call
    n: int  # samples per prompt
    prompt_len: int
    max_new: int
    greedy: bool


def _generation(cfg, params, mesh, prompts: int, n: int, requests: float, rows_cap, greedy: bool) -> Generation:
    """The call a request of `prompts` x `n` rows is split into (JaxSampler.generate): its program, arguments and
    calls per step (`requests` of them per step)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from twocircuit_jax.parallel import mesh as pmesh
    from twocircuit_jax.sampler import jax_sampler as js

    P, N = cfg.train.max_prompt_len, cfg.sampler.sampling.max_new_tokens  # the trainer's prompt bucket
    shards = pmesh.dp_size(mesh)
    per = js.call_prompts(rows_cap if rows_cap is not None else prompts * n, n, prompts, shards)
    calls = -(-prompts // per)
    f = jax.ShapeDtypeStruct
    row = NamedSharding(mesh, pmesh.row_spec(per, mesh, 2))
    one = NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (params, f((per, P), jnp.int32, sharding=row), f((per, P), jnp.int32, sharding=row))
    args += (f(key.shape, key.dtype, sharding=one),)
    args += tuple(f((), d, sharding=one) for d in (jnp.float32, jnp.int32, jnp.float32, jnp.int32))
    static = {"cfg": cfg.model, "max_new_tokens": N, "n": n, "greedy": greedy, "mesh": mesh}
    prog = _Bound(_FirstArgs(js.generate_tokens, cfg.model), {k: v for k, v in static.items() if k != "cfg"})
    return Generation(prog, args, Usage(requests * calls, per * n, False), per, n, P, N, greedy)


class _FirstArgs(NamedTuple):
    """generate_tokens with its leading static `cfg` bound, lowered like a jitted function."""

    jitted: Any
    cfg: Any

    def lower(self, *args, **kwargs):
        return self.jitted.lower(self.cfg, *args, **kwargs)

    @property
    def wrapped(self):
        return _FirstArgs(getattr(self.jitted, "wrapped", self.jitted), self.cfg)


def generation_programs(cfg, params, free_bytes: float | None) -> dict:
    """{name: Generation}: the embedded sampler's calls in a GRPO step of `cfg` (none with `sampler.backend: vllm`,
    whose engines run elsewhere: plan/engines.py). `generate`: the step's rollouts, prompts_per_step x n;
    `generate_eval`: the held-out evaluation's chunk (train/evaluate.py CHUNK prompts, one sample, greedy unless
    train.eval_greedy is off), eval_size / CHUNK chunks every eval_every steps. `params`: the trainer's parameters
    as ShapeDtypeStructs with their shardings; `free_bytes`: the memory per device the resident state leaves, which
    sizes `sampler.max_rows_per_call: auto` (None: every row in one call, as the CPU backend does). A multi-turn
    environment generates once per turn: max_turns calls of the same shape (an upper bound on the prompt)."""
    from twocircuit_jax.sampler import jax_sampler as js
    from twocircuit_jax.train.evaluate import CHUNK

    if cfg.sampler.backend != "jax":
        return {}
    mesh = jax_mesh(params)
    s, t = cfg.sampler, cfg.train
    shards, tensor = mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"]
    P, N = t.max_prompt_len, s.sampling.max_new_tokens

    def cap(n):
        if s.max_rows_per_call != "auto":
            return s.max_rows_per_call
        return None if free_bytes is None else js.rows_that_fit(cfg.model, free_bytes, P, N, n, shards, tensor)

    turns = cfg.env.max_turns if cfg.env.enabled else 1
    out = {"generate": _generation(cfg, params, mesh, t.prompts_per_step, s.n, turns, cap(s.n), False)}
    if t.eval_size and t.eval_every:
        chunk = min(CHUNK, t.eval_size)
        evals = -(-t.eval_size // chunk) / t.eval_every
        out["generate_eval"] = _generation(cfg, params, mesh, chunk, 1, evals, cap(1), t.eval_greedy)
    return out


def jax_mesh(params):
    """The mesh the parameters' shardings name."""
    import jax

    return jax.tree.leaves(params)[0].sharding.mesh

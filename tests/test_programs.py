"""One assembly: the programs the shapes-only tools compile (step/abstract_step.py `abstract_programs`: what
scripts/comm_bytes.py counts and the accelerator export tests lower) are the programs a GRPOTrainer runs.

A real trainer on a tiny config runs one GRPO step with every jitted program it calls observed: the arguments it
passes (shape, dtype, sharding) are recorded. The shapes-only assembly of the same config must list the same
programs with the same abstract arguments, and each program lowered on its arguments must give the same StableHLO
text (hashed): dense with separate ℓ_old and ℓ_ref passes; the PRF mask with PowerSGD (its warm-up and steady
train steps, one step each); the anchor with a low-rank
basis it owns, the probe, and its dense reference pass; the fused ℓ_old path under PowerSGD."""

import dataclasses
import hashlib

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from tiny_run import tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.step.abstract_step import abstract_programs
from twocircuit_jax.step.programs import PhasedTrainStep
from twocircuit_jax.train import loop

pytestmark = pytest.mark.slow  # builds a GRPOTrainer and runs a step


def _spec(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    return x


class _Observed:
    """Calls the trainer's program unchanged and keeps the abstract form of the first call's arguments."""

    def __init__(self, jitted):
        self.jitted, self.calls = jitted, []

    def __call__(self, *args, **kwargs):
        if not self.calls:
            self.calls.append((jax.tree.map(_spec, args), kwargs))
        return self.jitted(*args, **kwargs)


def _canonical(x):
    """One spelling of a NamedSharding: mesh axes of size 1 dropped from the spec (P('data') and
    P(('data', 'fsdp'), None) are one layout when fsdp = 1, but lower to different annotations)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding):
        return x
    size = s.mesh.shape
    keep = lambda e: tuple(a for a in ((e,) if isinstance(e, str) else e) if size[a] > 1) if e is not None else ()  # noqa: E731
    spec = [keep(e) for e in s.spec]
    spec = [None if not e else e[0] if len(e) == 1 else e for e in spec]
    while spec and spec[-1] is None:
        spec.pop()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(s.mesh, P(*spec)), weak_type=x.weak_type)


def _fingerprint(jitted, args, kwargs) -> str:
    """The program's StableHLO (no debug locations), hashed, on canonically spelled argument shardings."""
    text = jitted.lower(*jax.tree.map(_canonical, args), **kwargs).as_text()
    return hashlib.sha256(text.encode()).hexdigest()


def _same_args(a, b) -> bool:
    """Same tree, shapes, dtypes and weak types, and equivalent shardings (an output XLA placed, e.g. ℓ_old fed to
    the diagnostics, names its spec P('data') where the shapes side writes P(('data', 'fsdp'), None))."""
    (fa, ta), (fb, tb) = jax.tree_util.tree_flatten(a), jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    return all(
        (x.shape, x.dtype, getattr(x, "weak_type", False)) == (y.shape, y.dtype, getattr(y, "weak_type", False))
        and x.sharding.is_equivalent_to(y.sharding, len(x.shape))
        for x, y in zip(fa, fb)
    )


NAMES = ("train_step", "diagnostics", "logp_old", "logp_ref", "logp_dense", "logp_anchor_ref", "probe_sums", "fidelity")

CASES = {
    "dense": dict(grpo={"kl_coef": 0.01}),
    # a warm-up of one reduce: the train step is two programs (PhasedTrainStep), step 1 runs the plain mean's,
    # step 2 the compressed one's
    "prf_powersgd": dict(
        grpo={"kl_coef": 0.01},
        fast={"codec": {"type": "prf_mask", "p": 0.5}, "grad_codec": {"type": "powersgd", "rank": 2, "start_after": 1}},
        train={"steps": 2},
    ),
    "anchor_lowrank_probe": dict(
        grpo={"kl_coef": 0.01},
        fast={"codec": {"type": "lowrank", "rank": 3}, "codec_reference": True},
        anchor={"enabled": True, "cadence": 2, "delay": 2, "projection": {"enabled": False}},
        train={"probe_every": 1},
    ),
    "fused_powersgd": dict(
        grpo={"kl_coef": 0.0},
        fast={"grad_codec": {"type": "powersgd", "rank": 2, "start_after": 0}},
        train={"prompts_per_update": 4},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_trainer_runs_the_programs_built_from_shapes(tmp_path, case):
    sections = dict(CASES[case])
    train = {"steps": 1, "final_checkpoint": False, **sections.pop("train", {})}
    data = tiny_config(train=train, eval={"at_start": False, "at_end": False}, **sections)
    cfg = load_config(data=data)
    with loop.GRPOTrainer(cfg, str(tmp_path / "run"), show_progress=False) as tr:
        assert tr.built.model_cfg == cfg.model  # the shapes side builds cfg.model
        programs = tr.built.programs
        observed = {n: _Observed(getattr(programs, n)) for n in NAMES if getattr(programs, n) is not None}
        swap = dict(observed)
        if isinstance(programs.train_step, PhasedTrainStep):  # each of its two programs observed on its own
            ts = programs.train_step
            observed["train_step_warmup"], observed["train_step"] = _Observed(ts.warmup), _Observed(ts.steady)
            swap["train_step"] = PhasedTrainStep(
                observed["train_step_warmup"], observed["train_step"], ts.warmup_reduces
            )
        # every later call reads its programs from the built run: the spies go into a new one
        tr.built = dataclasses.replace(tr.built, programs=programs._replace(**swap))
        if tr.built.anchor is not None:
            observed["anchor_fire"] = _Observed(tr.built.anchor._fire_jit)
            tr.built.anchor._fire_jit = observed["anchor_fire"]
        for _ in range(train["steps"]):
            tr.step()
        ran = {n: o.calls[0] for n, o in observed.items() if o.calls}
        jax.clear_caches()  # a cached lowering keeps the spelling of the shardings of the call that made it
        real = {n: _fingerprint(observed[n].jitted, *ran[n]) for n in ran}
    shapes = abstract_programs(cfg, jax.devices())
    assert set(shapes) == set(ran), (sorted(shapes), sorted(ran))
    for n, prog in shapes.items():
        args, kwargs = ran[n]
        assert _same_args(prog.args, args), n
        assert prog.kwargs == kwargs, n
        assert _fingerprint(prog.jitted, prog.args, prog.kwargs) == real[n], n
    # the check can fail: the same step without the anchor's merger, or with per-replica diagnostics, is another
    if case in ("anchor_lowrank_probe", "fused_powersgd"):
        assert _fingerprint(_variant(case, cfg, tr), shapes["train_step"].args, {}) != real["train_step"]


def _variant(case, cfg, tr):
    """The trainer's step less one piece: the anchor's merger, or (fused under PowerSGD) the gather of the
    diagnostics' inputs over the replicas."""
    from twocircuit_jax.step.grpo_step import make_grpo_loss
    from twocircuit_jax.step.train_step import build_train_step

    loss = tr.built.programs.loss_fn
    if case == "fused_powersgd":
        loss = make_grpo_loss(tr.built.model_cfg, cfg.grpo, 4, None, None, diagnose=True)
    return build_train_step(
        loss,
        tr.built.optimizer,
        tr.built.state_sh,
        tr.built.mesh,
        circuit_sharding=tr.built.cs_sh,
        grad_fn=tr.built.fast.grad_fn(tr.built.state_sh.params),
        absorb_aux=tr.built.fast.absorb_aux,
    )

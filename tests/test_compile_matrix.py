"""Every combination the configs allow traces, from shapes alone: activation codec (none, prf_mask, lowrank,
sr_quant) x gradient codec (none, PowerSGD) x anchor (off, on) x mesh (data 8; stage 2 x data 4; fsdp 2 x data 4) on
conftest's 8 fake CPU devices, each program a run of it executes (step/abstract_step.py `abstract_programs`: the
train step, the log-prob passes, the anchor's fire) lowered on a 2-layer, 32-wide model (one layer a stage, the
codec boundary after layer 0; the layers unroll, so more of them only add tracing time). PowerSGD with fsdp > 1 is
hierarchical (manual over `data`, the parameters fsdp-sharded: fast/powersgd.py); with data = 1 it has nothing to
compress and is refused.

The staged column with PowerSGD is the regression of the gradient codec's shard_map (manual over the batch axes)
around the pipeline's (manual over `stage`): with an activation codec it ended in "context mesh ... should match the
aval mesh" (fast/grad_fn.py). It runs in the fast suite; the full product (lowered) and the XLA compile of the staged
PowerSGD steps are slow."""

import itertools

import jax
import pytest

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.step.abstract_step import abstract_programs

MODEL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "qkv_bias": False,
}
ACT = {
    "none": {"type": "none"},
    "prf_mask": {"type": "prf_mask", "p": 0.5},
    "lowrank": {"type": "lowrank", "rank": 3},
    "sr_quant": {"type": "sr_quant", "quant_bits": 2, "quant_block": 16},
}
GRAD = {"none": {"type": "none"}, "powersgd": {"type": "powersgd", "rank": 2}}
MESH = {"data8": {"data": 8}, "stage2": {"data": 4, "stage": 2}, "fsdp2": {"data": 4, "fsdp": 2}}
REFUSED_MESH = {"fsdp8": {"data": 1, "fsdp": 8}}


def config(act, grad, anchor, mesh, kl=0.0):
    return load_config(
        data={
            "tokenizer": "char",
            "model": MODEL,
            "mesh": {**MESH, **REFUSED_MESH}[mesh],
            "sampler": {"n": 4, "sampling": {"max_new_tokens": 4}},
            "task": {"type": "reasoning_gym", "dataset": "chain_sum", "train_size": 8, "eval_size": 8},
            "grpo": {"kl_coef": kl},
            "fast": {"pp_size": 2, "codec": ACT[act], "grad_codec": GRAD[grad]},
            "anchor": {"enabled": anchor, "cadence": 2, "delay": 2, "projection": {"enabled": False}},
            "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 4},
        }
    )


def lower_all(cfg, compile_step=False) -> dict:
    progs = abstract_programs(cfg, jax.devices())
    for name, prog in progs.items():
        low = prog.lower()
        if compile_step and name.startswith("train_step"):  # with PowerSGD's warm-up, both of its programs
            low.compile()
    return progs


def _expected(cfg) -> set:
    """PowerSGD with its default warm-up (start_after 100) adds the warm-up's own train step (step/programs.py
    PhasedTrainStep)."""
    staged, anchor = cfg.mesh.stage > 1, cfg.anchor.enabled
    out = {"train_step"} | ({"logp_old", "diagnostics"} if staged else set())
    out |= {"train_step_warmup"} if cfg.fast.grad_codec_type == "powersgd" else set()
    return out | ({"anchor_fire"} if anchor else set())


ALLOWED = list(itertools.product(sorted(ACT), sorted(GRAD), (False, True), sorted(MESH)))
# The slow product leaves out the combinations the fast tests below already lower (PowerSGD without the anchor on
# the staged and fsdp meshes, every activation codec): every allowed combination is lowered once per run.
FAST_COVERED = {(a, "powersgd", False, m) for a in ACT for m in ("stage2", "fsdp2")}
PRODUCT = [c for c in ALLOWED if c not in FAST_COVERED]


@pytest.mark.parametrize("act", sorted(ACT))
def test_staged_powersgd_with_each_activation_codec_traces(act):
    cfg = config(act, "powersgd", False, "stage2")
    progs = lower_all(cfg)
    assert set(progs) == _expected(cfg)
    assert progs["train_step"].args[1].grad is not None  # PowerSGD's state: the step is the codec's


@pytest.mark.parametrize("act", sorted(ACT))
def test_powersgd_with_fsdp_is_hierarchical_and_refused_without_data_replicas(act):
    cfg = config(act, "powersgd", False, "fsdp2")
    progs = lower_all(cfg)
    assert set(progs) == _expected(cfg)
    err = progs["train_step"].args[1].grad  # the error memory: one per data replica, fsdp-split like its parameter
    assert err is not None
    with pytest.raises(ConfigError, match=r"fast\.grad_codec.*data=1 and fsdp=8"):
        abstract_programs(config(act, "powersgd", False, "fsdp8"), jax.devices())


@pytest.mark.slow
@pytest.mark.parametrize("act,grad,anchor,mesh", PRODUCT, ids=["-".join(map(str, c)) for c in PRODUCT])
def test_every_allowed_combination_traces(act, grad, anchor, mesh):
    cfg = config(act, grad, anchor, mesh)
    assert set(lower_all(cfg)) == _expected(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("act", ["prf_mask", "sr_quant"])  # a masked and a packed wire; all four lower above
def test_staged_powersgd_step_compiles(act):
    """XLA too (the CPU compiler aborts on some partially manual programs, parallel/pipeline.py): the staged step
    with PowerSGD and each activation codec, with the anchor and a KL term (its reference pass)."""
    cfg = config(act, "powersgd", True, "stage2", kl=0.01)
    assert {"logp_ref", "anchor_fire"} <= set(lower_all(cfg, compile_step=True))

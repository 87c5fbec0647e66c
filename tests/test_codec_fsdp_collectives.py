"""On a data 2 x fsdp 4 mesh the compressed program sends no more than the dense one (issue #53, item 3).

A small model (hidden 128, two scanned layers, every matrix divisible by the 4-way FSDP split) with the prf_mask
codec and hierarchical PowerSGD (start_after 0: the compressed reduction alone), micro-batched (train.micro_batch_per_device 1,
so the gradient is accumulated over a scan), compiled ahead of time on conftest's 8 fake CPU devices against its
dense twin (scripts/comm_bytes.py `dense_twin`: no codecs). Checked:
  - the compressed train step's collective bytes as the program runs (fast/hlo_bytes.py `run_bytes`: operand
    bytes times the trip counts of the loops around them, scripts/comm_bytes.py's run_collective_bytes) are at most
    the dense step's plus the gradient codec's own payload (its compressed-branch wire bytes: P, Q and the leaves it
    leaves uncompressed), plus 1 KiB of scalar reductions. The plain text count (`collective_bytes_from_hlo`) reads
    each loop body once, and the codec's hooked layer cuts the layer scan into two scans, each with its own copy
    of the layer's FSDP gathers: two bodies in the text for the same traffic;
  - PowerSGD's factors are formed blockwise: its own collectives carry [.., n, r] / [.., m, r] factors, never a
    whole [n, m] matrix (an all-gather of M over fsdp to form P = M·Q, an all-reduce of Ĝ = P̂·Qᵀ);
  - neither compile prints XLA's "Involuntary full rematerialization" (the SPMD partitioner replicating a tensor it
    cannot reshard: printed by C++ to fd 2, so fd 2 is captured around each compile).
"""

import contextlib
import os
import tempfile

import pytest
from scripts_module import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = {
    "name": "codec_fsdp",
    "model": {
        "vocab_size": 128,
        "hidden_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "compute_dtype": "bfloat16",
        "scan_layers": True,
        "remat": "full",
    },
    "mesh": {"data": 2, "fsdp": 4, "tensor": 1},
    "sampler": {"n": 4, "sampling": {"max_new_tokens": 8}},
    "grpo": {"kl_coef": 0.001},
    "fast": {
        "codec": {"type": "prf_mask", "p": 0.95, "exact_k": True, "rescale_mode": "constant"},
        "pp_size": 2,
        "grad_codec": {"type": "powersgd", "rank": 2, "start_after": 0, "compress_embeddings": True},
    },
    "anchor": {"enabled": False},
    "train": {"prompts_per_step": 4, "prompts_per_update": 4, "max_prompt_len": 8, "micro_batch_per_device": 1},
}


@contextlib.contextmanager
def captured_fd2():
    """Everything written to file descriptor 2 (XLA's C++ log included) while inside, as out[0] after the block."""
    out = [""]
    with tempfile.TemporaryFile(mode="w+b") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out[0] = f.read().decode(errors="replace")


def _compiled_text(cfg):
    import jax

    from twocircuit_jax.step.abstract_step import abstract_train_step

    step = abstract_train_step(cfg, jax.devices())
    with captured_fd2() as err:
        text = step.jitted.lower(*step.args).compile().as_text()
    return text, err[0]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    import yaml

    from twocircuit_jax.config.run import load_config

    cb = load_script("comm_bytes")
    path = tmp_path_factory.mktemp("codec_fsdp") / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    cfg = load_config(str(path))
    return cfg, {"dense": _compiled_text(cb.dense_twin(cfg)), "compressed": _compiled_text(cfg)}


def test_compressed_collectives_at_most_dense_plus_payload(compiled):
    import jax

    from twocircuit_jax.fast.bytes import grad_allreduce_bytes
    from twocircuit_jax.fast.hlo_bytes import run_bytes
    from twocircuit_jax.model.qwen2 import init_params

    cfg, progs = compiled
    dense, comp = run_bytes(progs["dense"][0]), run_bytes(progs["compressed"][0])
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    payload = grad_allreduce_bytes(params, cfg.fast.grad_codec)["comm/bytes_compressed"]
    report = f"dense {dense['total']:.0f} {dense['counts']}; compressed {comp['total']:.0f} {comp['counts']}"
    assert comp["total"] <= dense["total"] + payload + 1024, f"{report}; payload {payload:.0f}"


def test_powersgd_factors_blockwise(compiled):
    """PowerSGD's own collectives (op names of its three products) carry factors, not matrices: in all at most its
    payload. Before the factors were pinned (fast/powersgd.py `_factor_pinner`), M was all-gathered over fsdp to
    form P = M·Q and Q = Mᵀ·P̂, and Ĝ = P̂·Qᵀ was built by an all-reduce of the whole [L, n, m] matrix."""
    import re

    import jax

    from twocircuit_jax.fast.bytes import COLLECTIVE_KINDS, collective_bytes_from_hlo, grad_allreduce_bytes
    from twocircuit_jax.model.qwen2 import init_params

    cfg, progs = compiled
    products = ("...nm,...mr->...nr", "...nm,...nr->...mr", "...nr,...mr->...nm")
    kinds = "|".join(COLLECTIVE_KINDS)
    is_coll = re.compile(rf"=\s.*?\s(?:{kinds})(?:-start)?\(")
    # the definitions stay (operand shapes are looked up by name); of the collectives only PowerSGD's own
    kept = [
        line
        for line in progs["compressed"][0].splitlines()
        if not is_coll.search(line) or any(f"/{p}/" in line for p in products)
    ]
    ours = collective_bytes_from_hlo("\n".join(kept))
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    payload = grad_allreduce_bytes(params, cfg.fast.grad_codec)["comm/bytes_compressed"]
    assert 0 < ours["total"] <= payload, (ours, payload)


@pytest.mark.parametrize("which", ["dense", "compressed"])
def test_no_involuntary_rematerialization(compiled, which):
    _, progs = compiled
    err = progs[which][1]
    lines = [line for line in err.splitlines() if "Involuntary full rematerialization" in line]
    assert not lines, lines[0][:600]

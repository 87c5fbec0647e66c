"""configs/recipes/: the research's workloads as complete configs. Each loads, starts from its shapes file (the same
model), has a mesh for its target, plans from shapes (shrunk to a few layers here, so a plan takes seconds, on
conftest's 8 fake CPU devices), and `twocircuit train` refuses it with one line naming the missing local path."""

import dataclasses
import glob
import os

import pytest

from twocircuit_jax import cli
from twocircuit_jax.config import load_config
from twocircuit_jax.config.sections import MathFilesTask
from twocircuit_jax.plan import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))
SHAPES = os.path.join(ROOT, "configs", "shapes", "qwen2p5_1p5b.yaml")
# recipe file -> (its shapes file, the target its mesh is for: a TPU slice, or the 8 GPUs JAX sees as 8 devices)
TARGET = {"v5e8": "tpu:v5e-8", "gpu8": "cpu:8"}
# a few layers, a narrow model and a small batch: what a plan checks holds at any size, and the 1.5B compile takes
# minutes
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
    "model.intermediate_size=128",
    "model.vocab_size=256",
    "model.eos_token_id=1",
    "model.pad_token_id=1",
    "model.max_position_embeddings=64",
    "model.logits_chunk=16",
    "fast.pp_size=2",
    "train.prompts_per_step=8",
    "train.prompts_per_update=4",
    "train.max_prompt_len=16",
    "sampler.sampling.max_new_tokens=16",
]


def _target(path):
    return next(t for key, t in TARGET.items() if f"_{key}" in os.path.basename(path))


def test_the_recipes_are_there():
    names = {os.path.basename(p) for p in RECIPES}
    for want in ("qwen2p5_math_1p5b_gpu8", "qwen2p5_math_1p5b_v5e8"):
        assert {f"{want}.yaml", f"{want}_dense.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_loads_with_its_shapes_and_mesh(path):
    cfg, shapes = load_config(path), load_config(SHAPES)
    # the pad id is left to the checkpoint (the default 0 is not compared with its config.json); the rest is the shapes'
    assert cfg.model.pad_token_id == 0
    assert dataclasses.replace(cfg.model, pad_token_id=shapes.model.pad_token_id) == shapes.model
    assert cfg.mesh == shapes.mesh
    assert cfg.base_model and cfg.tokenizer == "auto"
    assert isinstance(cfg.task, MathFilesTask) and cfg.task.train_files and cfg.task.eval_files
    assert "\\boxed{}" in cfg.task.prompt_template
    assert cfg.train.eval_every > 0 and cfg.train.checkpoint_every > 0
    target = _target(path)
    assert cfg.sampler.backend == ("jax" if target.startswith("tpu") else "vllm")
    sizes = targets.check_mesh(cfg, targets.parse(target))
    assert sizes["data"] * sizes["fsdp"] * sizes["tensor"] * sizes.get("stage", 1) == 8
    dense = path.endswith("_dense.yaml")
    assert (cfg.fast.codec_type == "none") == dense and cfg.anchor.enabled != dense
    if dense:  # the twin differs from its recipe in the circuits only
        twin = load_config(path.replace("_dense.yaml", ".yaml"))
        assert (cfg.task, cfg.sampler, cfg.train, cfg.optim, cfg.grpo) == (
            twin.task,
            twin.sampler,
            twin.train,
            twin.optim,
            twin.grpo,
        )


# Every recipe: the embedded sampler's generation on the TPU ones, the vLLM engines on an H100 on the GPU ones, and the
# anchor's programs on the two-circuit ones.
@pytest.mark.slow  # four compiles, 15-40 s each on the 2-core machine: `make test-fast` skips them
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.tpu_compile) if "v5e8" in os.path.basename(p) else p for p in RECIPES],
    ids=os.path.basename,
)
def test_recipe_plans_from_shapes(path, capsys):
    name = os.path.basename(path)
    args = ["plan", "--config", path, "--topology", "cpu:8"]
    if load_config(path).sampler.backend == "vllm":
        args += ["--sampler-chip", "h100-80gb"]
    rc = cli.main(args + [x for s in SMALL for x in ("--set", s)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "plan for cpu:8: 8 devices (data=2 stage=1 fsdp=4 tensor=1)" in out
    assert ("vLLM sampler on h100-80gb" in out) == ("gpu8" in name)
    assert ("anchor_fire" in out) == (not name.endswith("_dense.yaml"))
    assert any(line.startswith("generate ") for line in out.splitlines()) == ("v5e8" in name)  # embedded sampler


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_train_refuses_missing_local_paths(path, tmp_path, capsys):
    cfg = load_config(path)
    out = tmp_path / "run"
    rc = cli.main(["train", "--config", path, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "base_model" in err[0] and cfg.base_model in err[0] and "not found" in err[0]
    assert not out.exists()
    # with the model there, the next missing path is the training data
    rc = cli.main(["train", "--config", path, "--out", str(out), "--set", f"base_model={ROOT}/configs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "task.train_files" in err[0] and cfg.task.train_files[0] in err[0]


# The model fields of Qwen/Qwen2.5-Math-1.5B's config.json on the Hugging Face hub (no pad_token_id in it).
QWEN2P5_MATH_1P5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_model_section_agrees_with_the_checkpoint(path):
    """With base_model every model.* key the recipe sets must equal the checkpoint's (train/setup.py): checked against
    the checkpoint's config.json without its weights."""
    from twocircuit_jax.model.hf_io import config_from_hf
    from twocircuit_jax.train.setup import _check_model_section

    cfg = load_config(path)
    _check_model_section(cfg.model, config_from_hf(QWEN2P5_MATH_1P5B), cfg.base_model)


LAYOUTS = sorted(glob.glob(os.path.join(ROOT, "configs", "layouts", "*.yaml")))


def test_layouts_place_the_engines():
    """configs/layouts/: each starts from a recipe and changes where things run. On an 8-GPU host the one-host
    layout leaves the trainer GPUs 0-1, a mesh of two devices; the others reach their engines through endpoints,
    with exports on a shared folder and the secret from a file; on this host (no GPU) the placed layout is refused
    with one line naming sampler.devices."""
    from twocircuit_jax.sampler.placement import trainer_gpus

    names = {os.path.basename(p): load_config(p) for p in LAYOUTS}
    assert set(names) == {"gpu8_engines6.yaml", "two_hosts_gpu.yaml", "tpu_v5e8_gpu_engines.yaml"}
    one = names["gpu8_engines6.yaml"]
    assert trainer_gpus(one.sampler, list(range(8))) == [0, 1]
    assert one.mesh.data * one.mesh.fsdp * one.mesh.tensor == 2 and one.sampler.engines == 6
    for name in ("two_hosts_gpu.yaml", "tpu_v5e8_gpu_engines.yaml"):
        sc = names[name].sampler
        assert sc.backend == "vllm" and sc.engines == 0 and len(sc.endpoints) >= 4, name
        assert sc.export_dir.startswith("/shared/") and sc.secret_file and sc.allow_remote, name
    assert names["tpu_v5e8_gpu_engines.yaml"].mesh == load_config(SHAPES).mesh  # the v5e-8's mesh, unchanged


def test_placed_layout_is_refused_on_a_host_without_gpus(tmp_path, capsys):
    from twocircuit_jax.sampler.placement import host_gpus

    if host_gpus():
        pytest.skip("this host has GPUs")
    out = tmp_path / "run"
    rc = cli.main(
        ["train", "--config", os.path.join(ROOT, "configs", "layouts", "gpu8_engines6.yaml"), "--out", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sampler.devices" in err[0] and "0 GPUs" in err[0], err
    assert not out.exists()

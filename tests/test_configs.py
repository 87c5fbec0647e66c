"""Every shipped YAML parses into a valid RunConfig; overrides and errors name the field."""

import glob
import os

import pytest

from twocircuit_jax.config import ConfigError, load_config, parse_set, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(
    glob.glob(os.path.join(ROOT, "configs", "*.yaml")) + glob.glob(os.path.join(ROOT, "configs", "shapes", "*.yaml"))
)


@pytest.mark.parametrize("path", SHIPPED, ids=[os.path.relpath(p, ROOT) for p in SHIPPED])
def test_shipped_config_parses(path, tmp_path):
    cfg = load_config(path)
    out = tmp_path / "resolved.yaml"
    save_config(cfg, str(out))
    assert load_config(str(out)) == cfg  # the resolved config written to a run folder loads back unchanged


def test_there_are_shipped_configs():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"demo.yaml", "tiny_base.yaml"} <= names


def test_overrides_and_errors(tmp_path):
    demo = os.path.join(ROOT, "configs", "demo.yaml")
    cfg = load_config(demo, ["fast.codec=prf_mask", "train.steps=3", "grpo.clip_high=0.2"])
    assert (cfg.fast.codec_type, cfg.train.steps, cfg.grpo.clip_high) == ("prf_mask", 3, 0.2)
    with pytest.raises(ConfigError, match=r"demo.yaml: fast.codec.type: got 'foo'; allowed"):
        load_config(demo, ["fast.codec=foo"])
    with pytest.raises(ConfigError, match=r"train.stepz: unknown key"):
        load_config(demo, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"grpo.clip_low: got 'x'; expected a number"):
        load_config(demo, ["grpo.clip_low=x"])
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_set("train.steps")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "none.yaml"))


# Total and non-embedding parameter counts from the model cards (Qwen2.5-1.5B: 1.54B / 1.31B; Qwen3-4B: 4.0B / 3.6B;
# Qwen3-8B: 8.2B / 6.95B), to the precision they are published: a shape config with a wrong width, head count or
# tying would miss them.
PUBLISHED = {
    "qwen2p5_1p5b.yaml": (1.54, 1.31, 0.005),
    "qwen3_4b.yaml": (4.0, 3.6, 0.05),
    "qwen3_8b.yaml": (8.2, 6.95, 0.05),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_configs_have_the_published_parameter_counts(name):
    import math

    import jax

    from twocircuit_jax.model.qwen2 import init_params

    cfg = load_config(os.path.join(ROOT, "configs", "shapes", name)).model
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) / 1e9
    heads = [k for k in ("embed", "lm_head") if k in shapes]
    non_embedding = total - sum(math.prod(shapes[k].shape) for k in heads) / 1e9
    want_total, want_non_embedding, tol = PUBLISHED[name]
    assert abs(total - want_total) <= tol and abs(non_embedding - want_non_embedding) <= tol, (total, non_embedding)

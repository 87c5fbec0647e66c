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

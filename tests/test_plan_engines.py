"""The vLLM side of `twocircuit plan` (plan/engines.py): arithmetic on shapes, checked against numbers worked by
hand, for a made-up model on a made-up GPU (round numbers) and for Qwen2.5-1.5B's shapes on an H100. The CLI's
errors come before any compile; one in-process plan of tiny on cpu:8 (slow: it compiles) prints and writes them."""

import json
import math
import os

import jax
import pytest

from twocircuit_jax import cli
from twocircuit_jax.config import load_config
from twocircuit_jax.model.qwen2 import param_count
from twocircuit_jax.plan import chips, engines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
QWEN_1P5B = os.path.join(ROOT, "configs", "shapes", "qwen2p5_1p5b.yaml")
GiB = 2**30

# The made-up model: 2 layers, H 8, 2 query heads and 1 KV head of 4, MLP 16, vocab 10, tied, q/k/v biases.
# Per layer: norms 2*8 + q 8*8 + k, v 2*8*4 + o 8*8 + MLP 3*8*16 + biases 8+4+4 = 608; 2 layers 1216; embedding
# 10*8 = 80; final norm 8: N = 1304. bf16: W = 2608 B; KV per token 2*2*1*4*2 = 32 B; a row of 6 + 4 tokens 320 B.
# Reserve on the toy GPU (max_num_seqs 8, 16 batched tokens): 1 GiB + 16*(3*16 + (2+2)*4 + 2*8)*2 = 2560
# + 2*8*10*4 = 640.
TOY_RESERVE = GiB + 2560 + 640
TOY = chips.GpuChip("toy", 2 * (TOY_RESERVE + 2608 + 5 * 320 + 100), 1e6, 1e3, 1e4, 0.0, "made up")


def toy_cfg():
    model = dict(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    model.update(intermediate_size=16, eos_token_id=2, pad_token_id=0)
    s = dict(n=4, sampling=dict(max_new_tokens=4), gpu_memory_utilization=0.5, dtype="bfloat16")
    return load_config(
        data={"model": model, "sampler": s, "train": dict(prompts_per_step=3, prompts_per_update=3, max_prompt_len=6)}
    )


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(chips.GPUS, "toy", TOY)
    monkeypatch.setitem(engines.VLLM_DEFAULTS, "toy", (8, 16))
    return toy_cfg()


def wave(r):  # by hand: prefill 2*1304*r*6 / 1e6, then 4 decode steps of (2608 + r*32*(6 + 4/2)) B at 1e4 B/s
    return 2 * 1304 * r * 6 / 1e6 + 4 * (2608 + 256 * r) / 1e4


def test_param_count_is_the_model_tree():
    from twocircuit_jax.model.qwen2 import init_params

    for sets in ([], ["model.tie_embeddings=false", "model.qkv_bias=false", "model.qk_norm=true"]):
        m = load_config(TINY, sets).model
        tree = jax.eval_shape(lambda k, m=m: init_params(m, k), jax.random.key(0))
        assert param_count(m) == sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    assert param_count(toy_cfg().model) == 1304


def test_toy_memory_and_rows(toy):
    d = engines.engine_plan(toy, "toy", None)
    assert d["params"] == 1304 and d["dtype"] == "bfloat16"
    assert d["weight_bytes"] == 2608 and d["kv_bytes_per_token"] == 32 and d["kv_bytes_per_row"] == 320
    assert d["reserve"] == {"overhead": GiB, "activations": 2560, "logits": 640, "total": TOY_RESERVE}
    assert d["kv_cache_bytes"] == pytest.approx(5 * 320 + 100)
    assert d["kv_rows"] == 5 and d["concurrent_rows"] == 5 and d["fits"]
    assert d["step_rows"] == 12 and d["waves"] == 3 and d["wave_rows"] == 5  # 3 prompts x 4 samples: 5, 5, 2


def test_toy_times(toy):
    d = engines.engine_plan(toy, "toy", None)
    s = d["decode_step"]
    assert s["bytes"] == 2608 + 5 * 256 and s["flops"] == 2 * 1304 * 5
    assert s["bound_s"] == pytest.approx(0.3888) and s["limit"] == "hbm"
    assert d["prefill_s"] == pytest.approx(0.07824)
    assert d["wave_s"] == pytest.approx(wave(5)) == pytest.approx(1.63344)
    assert d["generation_s"] == pytest.approx(2 * wave(5) + wave(2))
    assert d["engines"] is None and "per-engine time only" in d["note"]
    # at a hundredth of the toy's peak the decode step turns compute-bound: 2*1304*5 / 1e4 > 0.3888
    slow = engines.decode_step(5, 2608, 256, 2 * 1304, 1e4, 1e4)
    assert slow["limit"] == "compute" and slow["bound_s"] == pytest.approx(1.304)


@pytest.mark.parametrize(
    "bound, k, rows",
    [(5.0, 1, 12), (3.0, 2, 6), (2.0, 3, 4), (1.4, 4, 3), (1.3, 6, 2), (1.2, 12, 1), (1.0, None, None)],
)
def test_toy_engines_for_a_bound(toy, bound, k, rows):
    # one engine 4.546 s; 6 rows wave(5) + wave(1) 2.795 s; 4 rows 1.515 s; 3 1.397 s; 2 1.279 s; 1 1.161 s
    d = engines.engine_plan(toy, "toy", bound)
    assert d["engines"] == k and d["engine_rows"] == rows
    if k is None:
        assert "no engine count" in d["note"] and f"{wave(1):.2f} s" in d["note"]
    else:
        assert d["engines_generation_s"] <= bound
        assert d["engines_generation_s"] == pytest.approx((rows // 5) * wave(5) + (wave(rows % 5) if rows % 5 else 0))


def test_toy_rows_at_once_capped_by_max_num_seqs(monkeypatch):
    monkeypatch.setitem(chips.GPUS, "toy", TOY._replace(memory_bytes=2 * (TOY_RESERVE + 2608 + 100 * 320)))
    monkeypatch.setitem(engines.VLLM_DEFAULTS, "toy", (8, 16))
    d = engines.engine_plan(toy_cfg(), "toy", None)
    assert d["kv_rows"] == 100 and d["concurrent_rows"] == 8 and d["wave_rows"] == 8 and d["waves"] == 2
    assert d["generation_s"] == pytest.approx(wave(8) + wave(4))


def test_toy_does_not_fit(monkeypatch):
    monkeypatch.setitem(chips.GPUS, "toy", TOY._replace(memory_bytes=2 * (TOY_RESERVE + 2608 + 300)))
    monkeypatch.setitem(engines.VLLM_DEFAULTS, "toy", (8, 16))
    d = engines.engine_plan(toy_cfg(), "toy", 10.0)
    assert d["kv_rows"] == 0 and d["concurrent_rows"] == 0 and d["fits"] is False
    assert "does not fit" in d["note"] and "generation_s" not in d
    assert "DOES NOT FIT" in engines.render_engines(d)


def test_qwen_1p5b_on_h100():
    cfg = load_config(QWEN_1P5B, ["sampler.dtype=bfloat16"])
    d = engines.engine_plan(cfg, "h100-80gb", None)
    n = 1_543_714_304  # Qwen2.5-1.5B, tied
    assert d["params"] == n and d["weight_bytes"] == 2 * n
    assert d["kv_bytes_per_token"] == 28 * 2 * 2 * 128 * 2 == 28_672
    assert d["kv_bytes_per_row"] == 28_672 * (1024 + 3072)
    # reserve: 1 GiB + 16384 tokens * (3*8960 + (12 + 2*2)*128 + 2*1536) * 2 + 2 * 1024 * 151936 * 4
    assert d["reserve"]["total"] == GiB + 16384 * 32000 * 2 + 2 * 1024 * 151936 * 4
    kv_cache = 0.2 * 80e9 - 2 * n - d["reserve"]["total"]
    assert d["kv_cache_bytes"] == pytest.approx(kv_cache)
    assert d["kv_rows"] == math.floor(kv_cache / (28_672 * 4096)) == 81 and d["concurrent_rows"] == 81
    assert d["step_rows"] == 512 * 8 and d["waves"] == math.ceil(4096 / 81) == 51
    s = d["decode_step"]
    assert s["limit"] == "hbm" and s["bound_s"] == pytest.approx((2 * n + 81 * 28_672 * (1024 + 1536)) / 3.35e12)
    # the config's own sampler.dtype (auto) serves its float32 parameters: twice the bytes everywhere
    d32 = engines.engine_plan(load_config(QWEN_1P5B), "h100-80gb", None)
    assert d32["dtype"] == "float32" and d32["weight_bytes"] == 4 * n and d32["kv_bytes_per_token"] == 57_344


def test_engines_needed_fall_as_the_bound_grows():
    cfg = load_config(QWEN_1P5B, ["sampler.dtype=bfloat16"])
    one = engines.engine_plan(cfg, "h100-80gb", None)["generation_s"]
    ks = [engines.engine_plan(cfg, "h100-80gb", one * f)["engines"] for f in (0.05, 0.1, 0.25, 0.5, 0.99, 1.0, 2.0)]
    assert all(k is not None for k in ks) and ks == sorted(ks, reverse=True)
    assert ks[-3:] == [2, 1, 1]  # just under one engine's time takes two; at it or above, one


def test_too_little_memory_does_not_fit():
    cfg = load_config(QWEN_1P5B, ["sampler.gpu_memory_utilization=0.1"])  # 4.8 GB of an L40S for 6.2 GB of weights
    d = engines.engine_plan(cfg, "l40s", 100.0)
    assert d["concurrent_rows"] == 0 and not d["fits"] and "does not fit" in d["note"]


def test_render_names_the_numbers():
    cfg = load_config(QWEN_1P5B, ["sampler.dtype=bfloat16"])
    text = engines.render_engines(engines.engine_plan(cfg, "h100-80gb", 170.9))
    assert "h100-80gb" in text and "28,672 B/token" in text and "81 at once" in text
    assert "engines: 3 keep generation within the training bound 170.90 s" in text


def test_unknown_chip():
    with pytest.raises(engines.ConfigError, match="--sampler-chip.*'b200'.*h100-80gb, h200, a100-80gb, l40s"):
        engines.gpu("b200")


def _no_compile(monkeypatch):
    from twocircuit_jax.plan import report

    def refuse(*a, **k):
        raise AssertionError("compiled before the flag was checked")

    monkeypatch.setattr(report, "make_plan", refuse)


def test_cli_requires_the_chip_with_vllm(monkeypatch, capsys):
    _no_compile(monkeypatch)
    rc = cli.main(["plan", "--config", TINY, "--topology", "cpu:8", "--set", "sampler.backend=vllm"])
    err = capsys.readouterr().err
    assert rc == 2 and "--sampler-chip" in err and "required with sampler.backend: vllm" in err and "l40s" in err


def test_cli_unknown_chip(monkeypatch, capsys):
    _no_compile(monkeypatch)
    rc = cli.main(["plan", "--config", TINY, "--topology", "cpu:8", "--sampler-chip", "b200"])
    err = capsys.readouterr().err
    assert rc == 2 and "--sampler-chip" in err and "'b200'" in err and "h100-80gb" in err


@pytest.mark.slow  # compiles tiny's programs on cpu:8
def test_cli_plan_prints_and_writes_the_engines(tmp_path, capsys):
    path = tmp_path / "plan.json"
    args = ["plan", "--config", TINY, "--topology", "cpu:8", "--sampler-chip", "h100-80gb"]
    rc = cli.main(args + ["--set", "sampler.backend=vllm", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "vLLM sampler on h100-80gb" in out and "per-engine time only" in out  # cpu:8: no training bound
    e = json.loads(path.read_text())["engines"]
    assert e["gpu"] == "h100-80gb" and e["fits"] and e["train_bound_s"] is None and e["engines"] is None
    assert e["kv_bytes_per_token"] == 2 * 4 * 1 * 32 * 4 and e["step_rows"] == 16  # tiny: float32, 4 prompts x 4
    assert f"{e['kv_bytes_per_token']:,} B/token" in out
    assert e["concurrent_rows"] == 1024 and e["wave_rows"] == 16 and e["waves"] == 1  # all of the step in one wave
    assert "decode step" in out and "at 16 rows" in out and "16 rows in 1 wave," in out


def test_one_duration_format_serves_the_plan_table_and_the_engine_report():
    from twocircuit_jax.plan.table import seconds

    assert seconds(2.5e-4) == "250.00 µs"
    assert seconds(0.0123) == "12.300 ms"
    assert seconds(170.9) == "170.90 s"
    assert seconds(11382.814) == "11,382.81 s"

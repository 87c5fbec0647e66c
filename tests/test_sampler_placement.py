"""sampler.engines / devices / tensor_parallel / endpoints: each bad placement is one line naming the field, exit 2
through the CLI, before any engine starts; and the fleet's routing rule (sampler/fleet.py route) without engines."""

import os
import socket
import subprocess
import sys

import pytest
import yaml
from tiny_run import tiny_config

from twocircuit_jax.config import load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.sampler import placement
from twocircuit_jax.sampler.base import Rollout, prompt_seed
from twocircuit_jax.sampler.fleet import reassemble, route

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**sampler):
    return load_config(data=tiny_config(sampler={"backend": "vllm", **sampler}))


@pytest.mark.parametrize(
    "sampler, field, words",
    [
        ({"engines": 2, "devices": [[0], [0]]}, "sampler.devices", "must not overlap"),
        ({"engines": 2, "devices": [[0]]}, "sampler.devices", "one GPU list per local engine"),
        ({"engines": 1, "devices": [[0, 1]]}, "sampler.devices", "tensor_parallel"),
        ({"engines": 1, "devices": [[]]}, "sampler.devices", "non-empty"),
        ({"tensor_parallel": 2}, "sampler.weight_update", "weight_update: reload"),
        ({"engines": 0}, "sampler.engines", "at least one engine"),
        ({"endpoints": ["nohost"]}, "sampler.endpoints", "HOST:PORT"),
        ({"endpoints": ["h:1"]}, "sampler.export_dir", "every host reads"),
        ({"endpoints": ["h:1"], "export_dir": "shm"}, "sampler.export_dir", "every host reads"),
    ],
)
def test_bad_placement_names_the_field(sampler, field, words):
    with pytest.raises(ConfigError) as e:
        _cfg(**sampler)
    assert f"{field}:" in str(e.value) and words in str(e.value)


def test_placement_on_the_host():
    """A GPU the host does not have, and no GPU left to the trainer (host GPUs given explicitly: none here)."""
    sc = _cfg(engines=2, devices=[[0], [1]]).sampler
    assert placement.trainer_gpus(sc, [0, 1, 2]) == [2]
    with pytest.raises(ConfigError, match="leave at least one for the trainer"):
        placement.trainer_gpus(sc, [0, 1])
    with pytest.raises(ConfigError, match="names GPU 1, but this host has 1 GPUs"):
        placement.trainer_gpus(sc, [0])
    with pytest.raises(ConfigError, match="this host has 0 GPUs"):
        placement.trainer_gpus(sc, [])
    assert placement.trainer_gpus(_cfg().sampler) is None  # no devices: nothing narrowed
    assert placement.engine_env((2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3"} and placement.engine_env(()) == {}


def _cli(tmp_path, sampler: dict, env=None):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(sampler={"backend": "vllm", **sampler})))
    return subprocess.run(
        [sys.executable, "-m", "twocircuit_jax.cli", "train", "--config", str(cfg), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_exit_2(tmp_path):
    """Through `twocircuit train`: a config error, a GPU this host lacks (it has none: no NVIDIA driver here, or the
    test is skipped), an endpoint without a secret and one nobody answers. One line each, exit 2, no traceback."""
    if placement.host_gpus():
        pytest.skip("this host has GPUs: the 0-GPU message is not what it prints")
    r = _cli(tmp_path, {"engines": 2, "devices": [[0], [0]]})
    assert r.returncode == 2 and "sampler.devices" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _cli(tmp_path, {"engines": 2, "devices": [[0], [1]]})
    assert r.returncode == 2 and "this host has 0 GPUs" in r.stderr and "Traceback" not in r.stderr, r.stderr
    exports = str(tmp_path / "exports")
    env = {"TWOCIRCUIT_SAMPLER_TOKEN": ""}
    r = _cli(tmp_path, {"engines": 0, "endpoints": ["127.0.0.1:9"], "export_dir": exports}, env)
    assert r.returncode == 2 and "sampler.secret_file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    port = _free_port()
    r = _cli(
        tmp_path, {"engines": 0, "endpoints": [f"127.0.0.1:{port}"], "export_dir": exports, "secret_file": str(secret)}
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = [x for x in r.stderr.splitlines() if "error" in x]
    assert line and f"127.0.0.1:{port}" in line[-1] and "sampler.endpoints" in line[-1], r.stderr


def test_route_blocks():
    """Contiguous blocks over the live engines, sizes within one of each other, a group on one engine."""
    assert route(7, [0, 1, 2], 3) == [0, 0, 0, 1, 1, 2, 2]
    assert route(2, [0, 1, 2], 3) == [0, 1]
    assert route(4, [1], 2) == [1, 1, 1, 1]
    assert route(5, [0, 2], 3) == [0, 0, 0, 2, 2]
    with pytest.raises(Exception, match="no sampler engine is live"):
        route(3, [], 2)


def test_route_keys():
    """A key keeps its engine (key mod K) while that engine is live, else the next live one; deterministic."""
    assert route(4, [0, 1], 2, keys=[5, 6, 7, 8]) == [1, 0, 1, 0]
    assert route(4, [0, 2], 3, keys=[0, 1, 2, 3]) == [0, 2, 2, 0]
    assert route(2, [1], 3, keys=[0, 2]) == [1, 1]
    with pytest.raises(ValueError):
        route(2, [0], 1, keys=[1])


def test_seeds_follow_the_prompt():
    """A prompt's seed is the single engine's derivation (vllm_server: seed * 1_000_003 + i) for its index in the
    call, whichever engine serves it."""
    assert prompt_seed(7, 3) == (7 * 1_000_003 + 3) % (2**31 - 1)
    assert len({prompt_seed(0, i) for i in range(100)}) == 100


def test_reassemble_prompt_major():
    """Answers of two engines (engine 1 took prompts 0 and 2 after engine 0 failed them, say) come back in prompt
    order, n rows per prompt, at the oldest answer's version; a prompt missing or answered twice is an error."""
    n = 2
    a = Rollout([[1], [1, 1], [3], [3, 3]], [[-0.1], [-0.1, -0.1], [-0.3], [-0.3, -0.3]], [0, 1, 0, 1], 5)
    b = Rollout([[2], [2, 2]], [[-0.2], [-0.2, -0.2]], [1, 0], 4)
    out = reassemble(3, n, [([1], b), ([0, 2], a)])
    assert out.tokens == [[1], [1, 1], [2], [2, 2], [3], [3, 3]] and out.weight_version == 4
    assert out.logprobs[2:4] == [[-0.2], [-0.2, -0.2]] and out.truncated == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="not answered"):
        reassemble(3, n, [([0, 2], a)])
    with pytest.raises(ValueError, match="answered twice"):
        reassemble(2, n, [([0, 1], a), ([1], b)])


def test_episodes_pass_trajectory_ids_as_routing_keys():
    """envs/episodes.py gives a sampler that accepts keys (the fleet) each turn's live trajectory ids, so route()
    keeps every trajectory on one engine across turns; a sampler without `accepts_keys` gets the plain call (the
    scripted engine of tests/test_envs.py, which has no keys argument)."""
    import numpy as np
    from test_envs import TOK, ScriptedSampler, _guess

    from twocircuit_jax.config.sections import SamplingConfig
    from twocircuit_jax.envs.episodes import run_episodes

    class Keyed(ScriptedSampler):
        accepts_keys = True

        def generate(self, prompts, n, sampling, seed, keys=None):
            self.keys.append(list(keys))
            return super().generate(prompts, n, sampling, seed)

    _, fam, prob = _guess(20, max_turns=3)
    script = {"1-31?": "16", "1-31?16>": "24", "1-31?16>24<": "20"}  # every trajectory plays 3 turns

    def play(sampler):
        run_episodes(
            fam,
            [prob, prob],
            2,
            sampler,
            TOK,
            SamplingConfig(max_new_tokens=8),
            max_turns=3,
            prompt_len=32,
            format_penalty=0.0,
            rng=np.random.default_rng(0),
            seed_of_turn=lambda k: k,
        )
        return sampler

    assert len(play(ScriptedSampler(script.get)).calls) == 3  # no keys argument: still called
    keyed = Keyed(script.get)
    keyed.keys = []
    play(keyed)
    assert keyed.keys == [[0, 1, 2, 3]] * 3
    engines = [route(4, [0, 1], 2, keys=k) for k in keyed.keys]
    assert engines[0] == engines[1] == engines[2] == [0, 1, 0, 1]


def test_serve_sampler_secret_file_errors(tmp_path):
    """`twocircuit serve-sampler --secret-file`: a missing or empty file is one line and exit 2, before any engine."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, words in ((tmp_path / "missing", "No such file"), (empty, "is empty")):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "twocircuit_jax.sampler.vllm_server",
                "--model-dir",
                str(tmp_path),
                "--export-root",
                str(tmp_path),
                "--secret-file",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr

"""The one small interface every rollout engine implements (embedded JAX sampler, vLLM process)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from twocircuit_jax.config.sections import SamplingConfig


def prompt_seed(seed: int, i: int) -> int:
    """Prompt i's sampling seed in a request seeded `seed`: the vLLM server derives it, and a fleet sends it with each
    prompt (sampler/fleet.py), so a prompt draws alike whichever engine serves it."""
    return (int(seed) * 1_000_003 + int(i)) % (2**31 - 1)


class Rollout(NamedTuple):
    """Samples for `len(prompts) * n` rows, prompt-major: prompt i's samples are rows i*n .. i*n+n-1."""

    tokens: list  # list[list[int]]: generated token ids per row, EOS included when emitted
    logprobs: list  # list[list[float]]: sampler log-prob of each generated token (same lengths as tokens)
    truncated: list  # list[bool]: hit max_new_tokens without EOS
    weight_version: int  # version of the weights that generated these samples


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> Rollout:
        """Sample n continuations per prompt (token ids, no padding)."""

    def update_weights(self, params, version: int) -> None:
        """Make `params` (the trainer's dense parameter pytree) the sampling weights, tagged `version`."""

    def close(self) -> None:
        """Release resources (stop the process, free memory). Safe to call twice."""

"""Multi-turn environments (the `env` config section): the interface, the built-in games and the episode runner."""

from __future__ import annotations

from twocircuit_jax.envs.base import Env, EnvFamily, StepResult


def make_env(env_cfg) -> EnvFamily:
    """The environment family for an EnvConfig subclass (`env.type`). A section registered elsewhere (a test, a user
    module) brings its family with a `build()` method."""
    build = getattr(env_cfg, "build", None)
    if build is not None:
        return build()
    from twocircuit_jax.config.env import CalculatorEnv, GuessEnv

    if isinstance(env_cfg, GuessEnv):
        from twocircuit_jax.envs.guess import GuessFamily

        return GuessFamily(env_cfg)
    if isinstance(env_cfg, CalculatorEnv):
        from twocircuit_jax.envs.calculator import CalculatorFamily

        return CalculatorFamily(env_cfg)
    raise ValueError(
        f"env: no environment for config {type(env_cfg).__name__}; allowed env.type: guess, calculator, "
        "or a section with a build() method"
    )


__all__ = ["Env", "EnvFamily", "StepResult", "make_env"]

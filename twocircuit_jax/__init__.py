"""twocircuit_jax: two-circuit compressed RLVR (GRPO) in JAX/Flax.

The fast circuit (twocircuit_jax.fast) trains through lossy codecs; the anchor circuit (twocircuit_jax.anchor)
replays dense updates and keeps dense optimizer moments; the sampler (twocircuit_jax.sampler) generates rollouts
from the dense weights; twocircuit_jax.grpo holds the objective, twocircuit_jax.metrics the diagnostics.
"""

from twocircuit_jax import platforms as _platforms

# Before the imports below import jax: which runtimes may start is settled while jax can still be told
# (twocircuit_jax/platforms.py; on a host without a TPU, no TPU runtime warnings on the console).
_platforms.configure()

from twocircuit_jax.fast import (  # noqa: E402
    codecs as _codecs,  # noqa: F401  (registers the built-in codecs' config types)
    powersgd as _powersgd,  # noqa: F401  (registers the powersgd gradient codec)
)
from twocircuit_jax.model.hf_io import load_hf, save_hf  # noqa: E402
from twocircuit_jax.model.qwen2 import forward  # noqa: E402

__version__ = "0.1.0"


def swap_optimizer_moments(*args, **kwargs):
    """Write the anchor's dense moments into an optax AdamW state (see twocircuit_jax.anchor.swap)."""
    from twocircuit_jax.anchor.swap import swap_optimizer_moments as _swap

    return _swap(*args, **kwargs)


def __getattr__(name):
    # The trainer on first use: `import twocircuit_jax` stays light (no optimizer, sampler or checkpointing).
    if name == "GRPOTrainer":
        from twocircuit_jax.train.loop import GRPOTrainer

        return GRPOTrainer
    if name == "load_config":
        from twocircuit_jax.config.run import load_config

        return load_config
    raise AttributeError(f"module 'twocircuit_jax' has no attribute {name!r}")


__all__ = ["GRPOTrainer", "forward", "load_config", "load_hf", "save_hf", "swap_optimizer_moments", "__version__"]

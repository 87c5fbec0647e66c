"""The activation codecs, one file each, registered with their `fast.codec` config sections (see base.py). The
gradient codecs register through the same base module (`register_grad`; PowerSGD in fast/powersgd.py).

Importing this package registers the built-in codecs; `twocircuit_jax/__init__.py` does so, so any config load
knows their `type:` names.
"""

# Registration order is the order the fidelity map lists the codecs in (metrics/runs.py codec_order).
from twocircuit_jax.fast.codecs import prf_mask  # noqa: F401, I001  (registration, in this order)
from twocircuit_jax.fast.codecs import lowrank  # noqa: F401
from twocircuit_jax.fast.codecs import sr_quant  # noqa: F401
from twocircuit_jax.fast.codecs.base import (  # noqa: F401  (the interface)
    OLD,
    REF,
    TRAIN,
    ActivationCodec,
    GradCodec,
    Path,
    activation_codecs,
    grad_codecs,
    make_activation_codec,
    make_grad_codec,
    register_activation,
    register_grad,
)

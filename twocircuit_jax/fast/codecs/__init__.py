"""The activation codecs, one file each, registered with their `fast.codec` config sections (see base.py).

Importing this package registers the built-in codecs; `twocircuit_jax/__init__.py` does so, so any config load
knows their `type:` names.
"""

from twocircuit_jax.fast.codecs import lowrank, prf_mask, sr_quant  # noqa: F401  (registration)
from twocircuit_jax.fast.codecs.base import (  # noqa: F401  (the interface)
    OLD,
    REF,
    TRAIN,
    ActivationCodec,
    Path,
    activation_codecs,
    make_activation_codec,
    register_activation,
)

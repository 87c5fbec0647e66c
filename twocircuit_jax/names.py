"""Names every layer shares, kept in the lowest layer so that no module defines its own copy.

- `path_str(key_path)`: a jax key path as 'layers/q_proj/kernel' (the partition rules, the anchor's target leaves,
  PowerSGD's leaf plan, the fidelity probe and the weight export all key their leaves by it).
- the forward-path tags: which pass a forward belongs to. The fast circuit's codec may act on TRAIN, OLD and REF
  (as fast.codec_old_logprob / fast.codec_reference say); DENSE is the anchor's and the probe's pass, where no codec
  ever acts (design §3.1).
"""

TRAIN, OLD, REF, DENSE = "train", "old_logprob", "ref_logprob", "dense"
CODEC_TAGS = (TRAIN, OLD, REF)  # the passes a codec may act on
TAGS = CODEC_TAGS + (DENSE,)


def key_name(k) -> str:
    """One key of a jax key path: a dict key, an attribute name or a sequence index, as a string."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    """'layers/q_proj/kernel' for a jax key path; a flat dict keyed by such strings maps to the same names."""
    return "/".join(key_name(k) for k in path)

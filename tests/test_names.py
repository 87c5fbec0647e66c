"""The one key-path helper and the one table of forward-path tags (twocircuit_jax/names.py)."""

from typing import NamedTuple

import jax
import numpy as np

from twocircuit_jax.names import CODEC_TAGS, DENSE, TAGS, path_str


class _State(NamedTuple):
    basis: object


def test_path_str_names_dict_list_and_attribute_keys_like_jax():
    """Every kind of key a parameter or state pytree holds reads as jax's own simple key string."""
    tree = {"layers": {"q_proj": {"kernel": np.zeros(2)}}, "stack": [np.zeros(1), _State(np.zeros(1))]}
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    got = [path_str(p) for p, _ in flat]
    assert got == ["layers/q_proj/kernel", "stack/0", "stack/1/basis"]
    assert got == [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]


def test_tags_are_distinct_and_dense_is_no_codec_tag():
    assert len(set(TAGS)) == len(TAGS) == 4
    assert DENSE not in CODEC_TAGS

"""Every config field takes effect or is refused: docs/config.md lists them all (with the modules that read each),
and a field that no module outside config/ reads fails here."""

import os

import pytest
from scripts_module import load_script

from twocircuit_jax.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doc():
    return load_script("config_doc")


def test_every_field_is_read_somewhere_or_refused():
    doc = _doc()
    srcs = doc.sources()
    unread = [
        key
        for key, name, _, _ in doc.fields()
        if name != "type" and key not in doc.REFUSED and not doc.readers(name, srcs)
    ]
    assert not unread, f"config fields no module reads (wire them, or refuse all but the default): {unread}"
    assert not doc.readers("a_field_nobody_reads", srcs)  # the search can come back empty


@pytest.mark.parametrize("key", sorted(_doc().REFUSED))
def test_refused_fields_are_refused(key):
    with pytest.raises(ConfigError, match=key):
        load_config(data=_doc().REFUSED[key][1])


def test_docs_config_md_is_current():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == _doc().render(), "docs/config.md is stale: run python scripts/config_doc.py"


def test_types_registered_outside_the_package_are_not_listed():
    """A test module's own `type:` (registered at import, in the same process) is not a field of the package."""
    import collapse_task  # noqa: F401  (registers task type synthetic_collapse)

    from twocircuit_jax.config.base import _REGISTRY

    assert any("synthetic_collapse" in names for names in _REGISTRY.values())
    assert not [key for key, *_ in _doc().fields() if "synthetic_collapse" in key]

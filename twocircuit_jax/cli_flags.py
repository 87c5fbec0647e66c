"""Repeated command-line flags: each option of a parser (and of its sub-commands) either accumulates or refuses a
second use with exit 2. Its own module so that every entry point's parser can use it (`twocircuit` in cli.py, the
vLLM sampler process's own parser in sampler/vllm_server.py) without an import cycle through cli.py."""

from __future__ import annotations

import argparse

# Flags that add up when repeated (--set, --checkpoint), and --help and --version (they exit at once); every other
# flag may be given once.
_ACCUMULATE = (
    argparse._AppendAction,
    argparse._ExtendAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
)
_ONCE = (argparse._StoreAction, argparse._StoreConstAction)  # store_true/false are _StoreConstAction subclasses
_GIVEN = "_twocircuit_given"  # namespace attribute: the dests set so far (removed after parsing)


def _once(cls):
    """A subclass of the argparse action `cls` that exits 2 ("flag --x given twice") on a second use, where argparse
    would silently keep the last value (`--out A --out B` wrote to B and said nothing)."""

    class Once(cls):
        def __call__(self, parser, namespace, values, option_string=None):
            given = getattr(namespace, _GIVEN, None)
            if given is None:
                given = set()
                setattr(namespace, _GIVEN, given)
            if self.dest in given:
                parser.error(f"flag {'/'.join(self.option_strings)} given twice; give it once")
            given.add(self.dest)
            super().__call__(parser, namespace, values, option_string)

    Once.__name__ = f"Once{cls.__name__}"
    return Once


def refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Every option of `parser` and of its sub-commands either accumulates (append/extend/count) or refuses a
    repeat. An action kind that is neither is an error here, so a new kind of flag cannot slip past."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in set(action.choices.values()):
                refuse_repeats(sp)
        elif not action.option_strings or isinstance(action, _ACCUMULATE):
            continue
        elif isinstance(action, _ONCE):
            action.__class__ = _once(type(action))
        else:
            raise TypeError(f"cli: flag {action.option_strings} has action {type(action).__name__}; decide its repeat")


def parse_once(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`parser.parse_args(argv)` with its flags under refuse_repeats (call that first), the bookkeeping removed."""
    args = parser.parse_args(argv)
    if hasattr(args, _GIVEN):
        delattr(args, _GIVEN)
    return args

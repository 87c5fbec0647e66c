"""Every `twocircuit` flag either accumulates when repeated or refuses the repeat (exit 2 naming it). Before, a
repeated single-valued flag kept its last value silently, and `eval --checkpoint A --checkpoint B` lost A."""

import argparse

import pytest

from twocircuit_jax.cli import _parser, main, parse_args
from twocircuit_jax.evaluation.suite import parse_checkpoints


def _value(action, k):
    """A value argparse accepts for `action` (the k-th of two distinct ones where it can)."""
    if action.choices:
        return str(list(action.choices)[0])
    if action.type in (int, float):
        return str(k + 1)
    return f"v{k}"


def _argv(action):
    if action.nargs == 0:
        return [action.option_strings[0]]
    return [action.option_strings[0], _value(action, 0)]


def _subcommands():
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _walk(sp, parse, capsys):
    """Each option of parser `sp` given twice through `parse(argv)`: both values kept, or exit 2 naming the flag."""
    positionals = [_value(a, 0) for a in sp._actions if not a.option_strings and a.nargs != 0]
    flags = [a for a in sp._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert flags
    checked = 0
    for a in flags:
        required = [x for b in flags if b.required and b is not a for x in _argv(b)]
        once = _argv(a)
        twice = once + ([a.option_strings[-1]] if a.nargs == 0 else [a.option_strings[-1], _value(a, 1)])
        argv = [*positionals, *required, *twice]
        try:
            args = parse(argv)
        except SystemExit as e:
            assert e.code == 2, argv
            err = capsys.readouterr().err
            assert f"{a.option_strings[0]}" in err and "given twice" in err, (argv, err)
            checked += 1
            continue
        got = getattr(args, a.dest)
        assert isinstance(got, list) and len(got) >= 2, (argv, got)  # accumulated: both values kept
        assert [_value(a, 0), _value(a, 1)] == got[-2:], (argv, got)
        checked += 1
    assert checked == len(flags)
    args = parse([*positionals, *[x for b in flags if b.required for x in _argv(b)]])
    assert not hasattr(args, "_twocircuit_given")  # once each: parses, and leaves nothing behind


@pytest.mark.parametrize("cmd", sorted(_subcommands()))
def test_every_flag_accumulates_or_refuses_a_repeat(cmd, capsys):
    _walk(_subcommands()[cmd], lambda argv: parse_args([cmd, *argv]), capsys)


def test_every_sampler_server_flag_refuses_a_repeat(capsys):
    """The vLLM sampler process's own parser (`twocircuit serve-sampler` builds its argv from the config; the
    trainer's client passes the same flags; `python -m twocircuit_jax.sampler.vllm_server` by hand). Before, it was
    a plain argparse parser: `--port 1 --port 2` served on port 2 and said nothing."""
    from twocircuit_jax.sampler import vllm_server

    _walk(vllm_server.parser(), vllm_server.parse_args, capsys)
    with pytest.raises(SystemExit) as e:
        vllm_server.main(["--model-dir", "m", "--export-root", "e", "--port", "1", "--port", "2"])
    assert e.value.code == 2 and "flag --port given twice" in capsys.readouterr().err


def test_eval_keeps_every_checkpoint_flag(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    args = parse_args(
        ["eval", "--suite", "s.yaml", "--checkpoint", f"base={tmp_path}/a", "--checkpoint", f"dense={tmp_path}/b"]
    )
    assert parse_checkpoints(args.checkpoint) == [("base", f"{tmp_path}/a"), ("dense", f"{tmp_path}/b")]
    args = parse_args(["eval", "--suite", "s", "--checkpoint", f"{tmp_path}/a", f"{tmp_path}/b", "--checkpoint", "c"])
    assert args.checkpoint == [f"{tmp_path}/a", f"{tmp_path}/b", "c"]


def test_a_repeated_flag_exits_2_through_main(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export-hf", "--checkpoint", "x", "--out", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert e.value.code == 2
    assert "flag --out given twice" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

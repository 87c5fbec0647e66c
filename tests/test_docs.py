"""README.md and docs/*.md cannot rot silently: what they point at must exist and the commands they show must run.

- Links: every relative `[text](path)` (and `(path#anchor)`, images included) outside code resolves to a file or
  folder of the repository; http(s)/mailto links and pure `#anchors` are not checked, nor are the anchors themselves.
- Commands in fenced code blocks: every `twocircuit` invocation (at the start of a line, after `$ `, `srun`, an
  environment assignment, `&&` or `;`, inside a quoted shell string too, lines joined over a trailing `\\`) parses
  with the real CLI parser (twocircuit_jax/cli.py parse_args), and the --config (a sweep's: every arm, and --arms
  among them) / --suite file it names loads, under the command's --set overrides.
  Templates are filled by one rule: an optional group `[--flag VALUE]` is parsed as if given (its brackets dropped),
  `...` and `[...]` are dropped, a shell variable (`$i`) stands for 0, and a `--set key=VALUE` whose value is in
  capitals (`train.seed=S`) is parsed but left out of the config check. Lines that are templates rather than commands
  go in TEMPLATES with the reason.
- Commands in inline code spans (the README's command table, prose): the subcommand exists and every `--flag` is
  one of its options. Spans are often fragments (`twocircuit sweep --seeds`), so they are not parsed whole.
- Paths: every `configs/`, `scripts/`, `tests/`, `examples/`, `twocircuit_jax/`, `pallas_kernels/` or `docs/` file
  path named anywhere in them exists; a path with a component in capitals (`tests/FILE.py`) is a placeholder.

Nothing here compiles: importing the CLI module costs the package import (jax's, about 2 s) and no more.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from twocircuit_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

# Fenced lines (as joined, stripped) that show a command's shape rather than a command to run, and why. Keep short.
TEMPLATES: dict[str, str] = {}

OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "2>&1"}
# Tokens after which `twocircuit` is in command position (besides the start of a line and an env assignment).
COMMAND_POSITION = {"$", "srun", "do", "then", "time", "exec"} | OPERATORS
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(
    r"(?<![\w/.-])((?:configs|scripts|tests|examples|twocircuit_jax|pallas_kernels|docs)/[\w./-]*"
    r"\.(?:py|yaml|yml|md|sh|json|jsonl|png|txt))\b"
)
MAYBE_COMMAND = re.compile(r"(?:^|[\s\"'])twocircuit\s")
# `--set train.seed=S`: a value in capitals is a placeholder; that override is left out of the config check.
PLACEHOLDER_VALUE = re.compile(r"=[A-Z]+$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        return fh.read()


def _split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the prose with fenced blocks blanked, line numbers kept; the fenced lines as (line number, text))."""
    prose, fenced, fence = [], [], None
    for no, line in enumerate(text.splitlines(), 1):
        mark = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and mark:
            fence = mark.group(1)
        elif fence is not None and mark and mark.group(1).startswith(fence):
            fence = None
        elif fence is not None:
            fenced.append((no, line))
            line = ""
        prose.append("" if mark else line)
    return "\n".join(prose), fenced


def _joined(fenced: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Fenced lines with their `\\` continuations joined: (first line number, the logical line)."""
    out, parts, first = [], [], None
    for no, line in fenced:
        first = no if not parts else first
        text = line.strip()
        parts.append(text[:-1] if text.endswith("\\") else text)
        if not text.endswith("\\"):
            out.append((first, " ".join(parts)))
            parts = []
    return out


def _tokens(line: str) -> list[str]:
    """Shell words of a line, comments dropped; a quoted shell string holding a twocircuit command is opened up."""
    out = []
    for tok in shlex.split(line, comments=True):
        out.extend(_tokens(tok) if " " in tok and re.search(r"(^|\s)twocircuit\s", tok) else [tok])
    return out


def _invocations(tokens: list[str]) -> list[list[str]]:
    """The argument lists of the twocircuit commands among `tokens` (up to the next shell operator)."""
    found = []
    for i, tok in enumerate(tokens):
        before = tokens[i - 1] if i else None
        if tok != "twocircuit" or not (before is None or before in COMMAND_POSITION or ENV_ASSIGNMENT.match(before)):
            continue
        args = []
        for arg in tokens[i + 1 :]:
            if arg in OPERATORS:
                break
            args.append(arg)
        if args:
            found.append(args)
    return found


def _fill(args: list[str]) -> list[str]:
    """A template's arguments as a command's (the rule in the module doc)."""
    out, in_group = [], False
    for arg in args:
        if arg in ("...", "[...]", "…"):
            continue
        if arg.startswith("[-"):
            arg, in_group = arg[1:], True
        if in_group and arg.endswith("]"):
            arg, in_group = arg[:-1], False
        out.append("0" if re.fullmatch(r"\$\w+", arg) else arg)
    return out


def _fenced_commands():
    """(doc, line number, logical line, argument list) for every twocircuit command in a fenced block; the list is
    None where the line cannot be split into shell words (an unclosed quote)."""
    for doc in DOCS:
        for no, line in _joined(_split_fences(_read(doc))[1]):
            if not MAYBE_COMMAND.search(line):  # prose and output in a block: `twocircuit plan` in a tree, a table
                continue
            try:
                tokens = _tokens(line)
            except ValueError:
                yield doc, no, line, None
                continue
            for args in _invocations(tokens):
                yield doc, no, line, args


def _config_problem(ns) -> str | None:
    """What is wrong with the files a parsed command names, or None: the --suite file, and the --config file resolved
    under the command's --set overrides (a sweep's every arm, and its --arms among them), as the command would."""
    from twocircuit_jax.config import load_config
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.evaluation.suite import load_suite
    from twocircuit_jax.train.sweep import load_sweep, select_arms

    config, suite = getattr(ns, "config", ""), getattr(ns, "suite", "")
    sets = [s for s in getattr(ns, "set", []) if not PLACEHOLDER_VALUE.search(s)]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the paths in the docs are relative to the repository root
    try:
        if suite:
            load_suite(suite)
        if config and ns.cmd == "sweep":
            _, arms = load_sweep(config, sets)
            select_arms(arms, [a for a in ns.arms.split(",") if a] or None, config)
        elif config:
            load_config(config, sets)
    except ConfigError as e:
        return str(e)
    finally:
        os.chdir(cwd)
    return None


def _subcommands() -> dict:
    """Subcommand name -> its argparse parser, from the real parser."""
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    return {"": parser, **sub.choices}


def _relative_targets(text: str) -> list[str]:
    """The file parts of the relative links in a markdown text, outside code: no URLs, no pure #anchors."""
    out = []
    for m in LINK.finditer(CODE_SPAN.sub("", _split_fences(text)[0])):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s), mailto
            out.append(target)
    return out


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in _relative_targets(_read(doc)):
            if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))):
                broken.append(f"{doc}: ({target})")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_fenced_twocircuit_commands_parse():
    failures, seen = [], 0
    for doc, no, line, args in _fenced_commands():
        if line in TEMPLATES:
            continue
        seen += 1
        if args is None:
            failures.append(f"{doc}:{no}: {line}\n    unbalanced quotes")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = cli.parse_args(_fill(args))
        except SystemExit:
            failures.append(f"{doc}:{no}: {line}\n    {err.getvalue().strip().splitlines()[-1]}")
            continue
        problem = _config_problem(ns)
        if problem:
            failures.append(f"{doc}:{no}: {line}\n    {problem}")
    assert not failures, "commands in the docs that do not parse:\n" + "\n".join(failures)
    assert seen > 20, f"only {seen} twocircuit commands found in fenced blocks: is the extraction broken?"


def test_templates_are_still_in_the_docs():
    """An allow-listed template that left the docs is removed from TEMPLATES too."""
    lines = {line for doc in DOCS for _, line in _joined(_split_fences(_read(doc))[1])}
    assert not set(TEMPLATES) - lines


def test_inline_twocircuit_spans_name_real_flags():
    subs, failures, seen = _subcommands(), [], 0
    for doc in DOCS:
        for m in CODE_SPAN.finditer(_split_fences(_read(doc))[0]):
            words = m.group(2).split()
            if len(words) < 2 or words[0] != "twocircuit" or not re.fullmatch(r"[a-z][a-z-]*|-.*", words[1]):
                continue  # not a command; `twocircuit 0.1.0 (jax ...)` is --version's output
            seen += 1
            cmd = "" if words[1].startswith("-") else words[1]
            if cmd not in subs:
                failures.append(f"{doc}: `{m.group(2)}`: no subcommand {cmd!r}")
                continue
            for word in words[1:]:
                if word in OPERATORS:
                    break
                flag = word.lstrip("[").rstrip("]").split("=", 1)[0]
                if flag.startswith("--") and flag not in subs[cmd]._option_string_actions:
                    failures.append(f"{doc}: `{m.group(2)}`: {cmd or 'twocircuit'} has no {flag}")
    assert not failures, "inline commands naming what the CLI lacks:\n" + "\n".join(failures)
    assert seen > 20, f"only {seen} inline twocircuit spans found: is the extraction broken?"


def test_named_repo_paths_exist():
    missing = []
    for doc in DOCS:
        for m in PATH.finditer(_read(doc)):
            path = m.group(1)
            if any(part.isupper() for part in re.split(r"[/.]", path)):  # tests/FILE.py: a placeholder
                continue
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize(
    "line, expected",
    [
        ("$ twocircuit plan --config c.yaml  # note", [["plan", "--config", "c.yaml"]]),
        ("X=1 twocircuit train --out r &", [["train", "--out", "r"]]),
        ('ssh h --command "cd twocircuit && twocircuit train --out r"', [["train", "--out", "r"]]),
        ("pip install twocircuit", []),
    ],
)
def test_invocations_are_found_where_a_shell_would_run_them(line, expected):
    assert _invocations(_tokens(line)) == expected


def test_templates_fill_by_the_rule():
    args = ["train", "--config", "c.yaml", "[--set", "k=v]", "[...]", "--process-id", "$i", "[--resume]"]
    assert _fill(args) == ["train", "--config", "c.yaml", "--set", "k=v", "--process-id", "0", "--resume"]


def test_links_are_read_outside_code_without_urls_or_anchors():
    text = (
        "See [design](docs/design.md#why), ![fig](figures/a.png) and [web](https://x.org/a.md), [top](#top).\n"
        "`[not](a link)`\n```\n[nor](this.md)\n```\n"
    )
    assert _relative_targets(text) == ["docs/design.md", "figures/a.png"]

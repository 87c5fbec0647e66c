"""docs/architecture.md's "One fully featured step": the modules a real run passes through, generated, not written.

    python scripts/step_trace.py            # rewrite the section between its markers in docs/architecture.md
    python scripts/step_trace.py --check    # exit 1 if the section is not what a run gives (tests/test_step_trace.py)

The run: configs/tiny.yaml with every circuit on (the PRF mask through its Pallas kernel, interpreted on the CPU;
PowerSGD; the anchor firing and swapping every tick; token TIS; the dense probe; the guard, warning; a checkpoint)
for three steps on the embedded JAX sampler, one device, in this process. A trace hook (sys.settrace on every
thread, call events only) sees each Python call into a package module and the nearest package frame above it, so a
call made by JAX while it traces a program (the model inside `jit`) counts for the module that asked for the trace.
What comes out:

- the modules in the order the run first reaches them, each with the module that first called it;
- the wiring modules: those that call into two or more other components of the package (a component: a
  subpackage such as `fast` or `sampler`; the utilities every layer uses, INFRA below, do not count) through
  modules they import. A call into a function handed over as an argument (a loss given to the micro-batch helper,
  the codec's hook given to the model) is a callback, not wiring. Every other module of the run calls into at most
  one other component.

What it costs: one callback per Python call of the run (JAX's tracing included), about 15% over the run's ~30 s.
What it cannot see: the vLLM server process (its own process; the client module is in the trace when
sampler.backend is vllm, not here), and the config's loading, which happens before the trainer is built.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
BEGIN, END = "<!-- step-trace:begin (scripts/step_trace.py) -->", "<!-- step-trace:end -->"
PACKAGES = ("twocircuit_jax", "pallas_kernels")
MAX_WIRING = 10  # the bound on what a reader must hold to follow a step
# The parts every layer may use (docs/architecture.md's bottom layers and the mesh): calling them is using a
# utility, not wiring two components together.
INFRA = {"config", "parallel", "names", "boundaries", "cli_flags", "outdir", "pallas_kernels", "provenance"}
SETS = [
    "fast.codec={type: prf_mask, p: 0.9, use_kernel: true}",
    "fast.kernel_interpret=true",
    "fast.grad_codec={type: powersgd, rank: 2, start_after: 0}",
    "anchor.enabled=true",
    "anchor.cadence=1",
    "anchor.delay=1",
    "anchor.swap.cadence=1",
    "train.probe_every=1",
    "grpo.tis=token",
    "train.steps=3",
    "train.checkpoint_every=3",
    "guard.enabled=true",
    "guard.action=warn",  # a rollback would rebuild and recompile every program: the same modules, twice the time
    "mesh.data=1",
]


def module_of(filename: str, cache: dict) -> str | None:
    """'twocircuit_jax.fast.circuit' for a file of the package or the kernels, None for anything else."""
    got = cache.get(filename, "")
    if got != "":
        return got
    name = None
    path = os.path.abspath(filename)
    for pkg in PACKAGES:
        base = os.path.join(ROOT, pkg) + os.sep
        if path.startswith(base) and path.endswith(".py"):
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            name = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    cache[filename] = name
    return name


def part_of(module: str) -> str:
    """The package part a module belongs to: its subpackage (`fast`), or itself if top-level (`names`)."""
    bits = module.split(".")
    if bits[0] == "pallas_kernels":
        return "pallas_kernels"
    return bits[1]


class Tracer:
    """First reach order and caller-to-callee module edges of every package call while installed."""

    def __init__(self):
        self.order: list[str] = []
        self.first_caller: dict[str, str | None] = {}
        self.edges: set[tuple[str, str]] = set()
        self._files: dict = {}

    def _hook(self, frame, event, arg):
        # a global trace function (sys.settrace) sees only Python calls, not the C calls a profile hook also gets;
        # returning None asks for no line events in the frame: one callback per Python call
        callee = module_of(frame.f_code.co_filename, self._files)
        if callee is None:
            return None
        caller, f = None, frame.f_back
        while f is not None:
            caller = module_of(f.f_code.co_filename, self._files)
            if caller is not None:
                break
            f = f.f_back
        if callee not in self.first_caller:
            self.order.append(callee)
            self.first_caller[callee] = caller if caller != callee else None
        if caller is not None and caller != callee:
            self.edges.add((caller, callee))
        return None

    def __enter__(self):
        threading.settrace(self._hook)
        sys.settrace(self._hook)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        threading.settrace(None)


def run_traced() -> Tracer:
    """The tracer of the trainer's construction and its run."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # one device whatever the caller's XLA_FLAGS (the test suite simulates 8): the trace is of the one-device run
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    from twocircuit_jax.config.run import load_config
    from twocircuit_jax.train.loop import GRPOTrainer

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SETS)
    with tempfile.TemporaryDirectory(prefix="step-trace-") as tmp, Tracer() as tr:
        trainer = GRPOTrainer(cfg, os.path.join(tmp, "run"), show_progress=False)
        try:
            trainer.run()
        finally:
            trainer.close()
    return tr


def imports_of(module: str, cache: dict) -> set:
    """The package modules `module` imports (every import statement, those inside functions too), read from its
    source: a call from a module into one it never imports is a callback (a function handed to it), not wiring."""
    if module in cache:
        return cache[module]
    import ast

    path = os.path.join(ROOT, *module.split(".")) + ".py"
    if not os.path.exists(path):
        path = os.path.join(ROOT, *module.split("."), "__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            base = os.path.join(ROOT, *n.split("."))
            if n.split(".")[0] in PACKAGES and (os.path.isfile(base + ".py") or os.path.isdir(base)):
                out.add(n)
    cache[module] = out
    return out


def calls_into(tr: Tracer, module: str, cache: dict) -> set:
    """The parts other than its own that `module` called into through a module it imports."""
    mine = imports_of(module, cache)
    return {part_of(b) for a, b in tr.edges if a == module and b in mine} - {part_of(module)} - INFRA


def wiring(tr: Tracer, cache: dict | None = None) -> list[str]:
    """Modules that call into two or more parts other than their own through their imports, in reach order."""
    cache = {} if cache is None else cache
    return [m for m in tr.order if len(calls_into(tr, m, cache)) >= 2]


def _path(module: str) -> str:
    rel = module.replace(".", "/")
    rel += "/__init__.py" if os.path.isdir(os.path.join(ROOT, rel)) else ".py"
    return rel.removeprefix("twocircuit_jax/")


def render(tr: Tracer) -> str:
    wires = wiring(tr)
    lines = [
        BEGIN,
        "",
        "Generated by `scripts/step_trace.py` from a 3-step run of `configs/tiny.yaml` with every circuit on (the PRF"
        " mask through its Pallas kernel, PowerSGD, the anchor firing and swapping every tick, token TIS, the dense"
        " probe, the guard, a checkpoint), JAX sampler, one device; `tests/test_step_trace.py` fails when this section is not"
        " what the run gives.",
        "",
        f"**Wiring: {len(wires)} modules** call, through modules they import, into two or more components other than"
        " their own (a component: a subpackage such as `fast`; the utilities every layer uses, "
        + ", ".join(f"`{p}`" for p in sorted(INFRA))
        + ", do not count, nor do callbacks). Every other module of the run is reached through one of their calls"
        " and calls into at most one other component:",
        "",
    ]
    cache: dict = {}
    for m in wires:
        parts = sorted(calls_into(tr, m, cache))
        lines.append(f"- `{_path(m)}` → {', '.join(parts)}")
    lines += ["", f"**The run's {len(tr.order)} modules** in the order it first reaches them (← the first caller):", ""]
    row = []
    for i, m in enumerate(tr.order, 1):
        c = tr.first_caller.get(m)
        mark = "**" if m in wires else ""
        row.append(f"{i}. {mark}`{_path(m)}`{mark}" + (f" ← `{_path(c)}`" if c else ""))
    lines += row + ["", END]
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    a, b = text.index(BEGIN), text.index(END) + len(END)
    return text[:a] + section + text[b:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.md's section differs")
    args = ap.parse_args(argv)
    tr = run_traced()
    section = render(tr)
    text = open(DOC).read()
    new = replace_section(text, section)
    n = len(wiring(tr))
    if os.environ.get("STEP_TRACE_DEBUG"):
        cache: dict = {}
        for m in tr.order:
            print(m, sorted(calls_into(tr, m, cache)), file=sys.stderr)
    if n > MAX_WIRING:
        print(f"{n} wiring modules, more than {MAX_WIRING}: {', '.join(wiring(tr))}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print("docs/architecture.md's step trace is stale: run python scripts/step_trace.py", file=sys.stderr)
            return 1
        return 0
    with open(DOC, "w") as fh:
        fh.write(new)
    print(f"wrote {DOC}: {len(tr.order)} modules, {n} wiring")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The import graph of the package and the kernels, read from the source (every import statement, including the
ones inside functions): no cycles, the kernels import nothing from the package, the two circuits import nothing
from each other (the loop wires them), and the layers docs/architecture.md states only go down."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("twocircuit_jax", "pallas_kernels")
FORBIDDEN = [  # (importer prefix, imported prefix, why)
    ("pallas_kernels", "twocircuit_jax", "the kernels are a leaf: the package passes in what they need"),
    ("twocircuit_jax.anchor", "twocircuit_jax.fast", "the anchor never sees the fast circuit; the loop wires them"),
    ("twocircuit_jax.fast", "twocircuit_jax.anchor", "the fast circuit never sees the anchor"),
]


def modules(root=ROOT) -> dict:
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def import_graph(mods: dict) -> dict:
    graph = {}
    for name, path in mods.items():
        pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:  # `from pkg import module` names a module; `from module import x` the module
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(graph: dict) -> list:
    return [
        f"{a} imports {b}: {why}"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        for src, dst, why in FORBIDDEN
        if a.startswith(src) and b.startswith(dst)
    ]


# Upward imports that remain, each with why it is still there; adding one or removing one fails test_layers_go_down
# (a removed one must leave this list, so the list only shrinks).
KNOWN_UPWARD = {
    ("twocircuit_jax.config.sections", "twocircuit_jax.sampler.http_guard"): "the request bounds' defaults",
    ("twocircuit_jax.sampler.export", "twocircuit_jax.train.faults"): "the export's named kill points",
}


def doc_layers(root=ROOT) -> list:
    """[{'cli'}, {'train', 'plan', ...}, ..., {'pallas_kernels'}] from docs/architecture.md's layer line, top first."""
    text = open(os.path.join(root, "docs", "architecture.md")).read()
    line = re.search(r"^`cli` →.*?(?=\n\n)", text, re.S | re.M).group(0)
    return [set(re.findall(r"`([a-z_]+)`", part)) for part in line.split("→")]


def layer_of(module: str, layers: list):
    """The layer index of a module: its subpackage or top-level module under twocircuit_jax, or pallas_kernels.
    None for the package root (its __init__ registers the codecs) and for anything the doc does not name."""
    parts = module.split(".")
    key = parts[0] if parts[0] == "pallas_kernels" else (parts[1] if len(parts) > 1 else None)
    return next((i for i, names in enumerate(layers) if key in names), None)


def upward(graph: dict, layers: list) -> dict:
    """{(importer, imported): (layer of importer, layer of imported)} for every import that goes up a layer."""
    out = {}
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb < la:
                out[(a, b)] = (la, lb)
    return out


def test_every_module_has_a_layer():
    layers = doc_layers()
    missing = sorted(m for m in modules() if m != "twocircuit_jax" and layer_of(m, layers) is None)
    assert missing == [], f"modules in no layer of docs/architecture.md: {missing}"


def test_layers_go_down():
    found = upward(import_graph(modules()), doc_layers())
    new = sorted(set(found) - set(KNOWN_UPWARD))
    gone = sorted(set(KNOWN_UPWARD) - set(found))
    assert new == [], f"upward imports against docs/architecture.md's layers: {new}"
    assert gone == [], f"no longer upward, remove from KNOWN_UPWARD: {gone}"


def test_no_import_cycles():
    assert cycles(import_graph(modules())) == []


def test_no_forbidden_edges():
    assert violations(import_graph(modules())) == []


def test_the_checks_catch_a_cycle_and_a_forbidden_edge(tmp_path):
    """A planted cycle and a planted kernel -> package import are both reported."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "twocircuit_jax" / "a.py").write_text("def f():\n    from twocircuit_jax import b\n")
    (tmp_path / "twocircuit_jax" / "b.py").write_text("from twocircuit_jax.a import f\n")
    (tmp_path / "pallas_kernels" / "k.py").write_text("from twocircuit_jax.b import f\n")
    graph = import_graph(modules(str(tmp_path)))
    assert cycles(graph) == [["twocircuit_jax.a", "twocircuit_jax.b"]]
    assert violations(graph) == ["pallas_kernels.k imports twocircuit_jax.b: " + FORBIDDEN[0][2]]


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """A planted parallel -> fast import (config-layer code reaching into the fast circuit) is reported, and a
    downward one is not, against the layers the real doc states."""
    for pkg in ("twocircuit_jax/parallel", "twocircuit_jax/fast", "pallas_kernels"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "twocircuit_jax" / "__init__.py").write_text("")
    (tmp_path / "twocircuit_jax" / "fast" / "wire.py").write_text("from twocircuit_jax.parallel import mesh\n")
    (tmp_path / "twocircuit_jax" / "parallel" / "mesh.py").write_text("")
    (tmp_path / "twocircuit_jax" / "parallel" / "pipe.py").write_text(
        "def f():\n    from twocircuit_jax.fast import wire\n"
    )
    layers = doc_layers()
    found = upward(import_graph(modules(str(tmp_path))), layers)
    assert list(found) == [("twocircuit_jax.parallel.pipe", "twocircuit_jax.fast.wire")]
    assert layer_of("twocircuit_jax.fast.wire", layers) < layer_of("twocircuit_jax.parallel.pipe", layers)


def private_imports(mods: dict) -> list[str]:
    """'importer: module._name' for each private name (one leading underscore) a module of the package takes from
    another: `from M import _name`, or `m._name` where `m` is bound to a package module by an import. A private
    name is its module's own business; another module that needs it needs a public name."""
    found = []
    for name, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        aliases = {}  # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__") and node.module != name:
                        found.append(f"{name}: {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in mods:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and aliases[node.value.id] != name
            ):
                found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_module_takes_another_modules_private_name(tmp_path):
    assert private_imports(modules()) == []
    # the check itself, on a hand-made package: both forms are found, a module's own and a dunder are not
    pkg = tmp_path / "twocircuit_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _f(): pass\n__all__ = []\n")
    (pkg / "b.py").write_text("from twocircuit_jax.a import _f, __all__\nimport twocircuit_jax.a as a\na._f()\n")
    (pkg / "c.py").write_text("from twocircuit_jax import a\nx = a._f\ndef _own(): pass\n_own()\n")
    got = private_imports(modules(str(tmp_path)))
    assert got == ["twocircuit_jax.b: twocircuit_jax.a._f", "twocircuit_jax.c: twocircuit_jax.a._f"], got

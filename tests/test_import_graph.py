"""The import graph of the package and the kernels, read from the source (every import statement, including the
ones inside functions): no cycles, the kernels import nothing from the package, and the two circuits import nothing
from each other (the loop wires them)."""

import ast
import os

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

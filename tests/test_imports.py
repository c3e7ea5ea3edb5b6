"""The harness's own modules import one another without circles (issue 31): every import counts,
the function-local ones too (a circle hidden by a lazy import is still a circle: each side
changes when the other does), and nothing reaches into another module's private names."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("oracle", "models", "exporters")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module, name or None)} over every import statement in it."""
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {(o, None) for a in node.names if (o := owner(a.name))}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = owner(f"{node.module}.{a.name}")
                    if sub and sub != owner(node.module):  # `from pkg import module`
                        deps.add((sub, None))
                    elif owner(node.module):
                        deps.add((owner(node.module), a.name))
        graph[m] = {d for d in deps if d[0] != m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = {m: {d for d, _ in deps} for m, deps in imports(modules()).items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_names_imported_across_modules():
    reached = sorted(f"{m} imports {d}.{n}" for m, deps in imports(modules()).items() for d, n in deps
                     if n and n.startswith("_") and not n.startswith("__"))
    assert reached == []


def test_the_harness_reaches_backends_only_through_the_registry():
    """No module of oracle/ imports exporters/ (oracle/backend.py names them in BUILTIN; a plugin is a
    `module:attr` too): the harness knows no backend by its code."""
    reached = sorted(f"{m} imports {d}" for m, deps in imports(modules()).items() if m.split(".")[0] == "oracle"
                     for d, _ in deps if d.split(".")[0] == "exporters")
    assert reached == []


def test_no_module_over_600_lines():
    """A module that grows past 600 lines is split by what a reader looks for (docs/architecture.md)."""
    long = sorted(f"{p.relative_to(ROOT)}: {n}" for d in (*PACKAGES, "benchmarks", "examples")
                  for p in (ROOT / d).rglob("*.py") if (n := len(p.read_text().splitlines())) > 600)
    assert long == []

"""No import cycle among the modules of hermes_service, type-only imports included.

Every module under ``hermes_service/`` is parsed with :mod:`ast` (nothing is imported), and
every import statement counts: at the top, under ``if TYPE_CHECKING:``, inside functions. A
cycle fails the test and is printed module by module. Generic on purpose: packages and
modules added later are found the same way.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hermes_service"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` under ``root`` (a package's own name for
    its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports anywhere in its
    text. ``from pkg import sub`` names the submodule when ``pkg.sub`` is a module, else
    ``pkg``; a relative import is resolved against the module's package."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in known else mod
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` binds the deepest module that exists
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, …, a]``) for each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(group, edges) for group in groups]


def _one_cycle(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of ``group`` (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 20 and "hermes_service.app" in edges      # the walk found the package
    found = cycles(edges)
    assert not found, "import cycles (type-only and function-level imports count):\n" + \
        "\n".join("  " + " -> ".join(c) for c in found)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from pkg import a\nfrom ..a import x\n")
    (pkg / "d.py").write_text("import os\nfrom . import a, sub\n")
    edges = graph(pkg)
    assert edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"},
                     "pkg.sub": {"pkg.a"}, "pkg.sub.c": {"pkg.a"},
                     "pkg.d": {"pkg.a", "pkg.sub"}}
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_the_service_objects_protocol_is_the_services_interface():
    """Modules that cannot import :mod:`hermes_service.services` without a cycle name its
    ``Services`` by :class:`~hermes_service.service_objects.ServiceObjects`: the two list the
    same public members (fields, properties, methods)."""
    from dataclasses import fields

    from hermes_service.service_objects import ServiceObjects
    from hermes_service.services import Services

    def public(names) -> set[str]:
        return {n for n in names if not n.startswith("_")}

    protocol = public([*ServiceObjects.__annotations__, *vars(ServiceObjects)])
    ours = public([*(f.name for f in fields(Services)), *vars(Services)])
    assert protocol == ours

"""The layers rule (docs/architecture.md): the mnote extension (``hermes_service/mnote/``) is
the outer layer. No module outside it imports it, except the one composition point
(:func:`hermes_service.installed.extensions`), and the core names no mnote concept in code:
no identifier containing ``mnote``, no string constant that is an mnote name (``mnote``,
``mnote_…``, ``MNOTE_…``, ``mnote.<key>``) outside docstrings — the config package included: the
``mnote:`` section (schema, defaults, typed settings, checks, restart-only keys) is the
extension's (``mnote/settings.py``), brought in through the seam's config hook. Words in
docstrings and comments are allowed.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hermes_service"
EXTENSION = PACKAGE / "mnote"
#: (module, function) allowed to import the extension: the composition point
COMPOSITION = {("installed.py", "extensions")}
MNOTE_NAME = re.compile(r"^(mnote([._]\w*)*|MNOTE_\w*)$", re.IGNORECASE)


def core_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if EXTENSION not in p.parents)


def _module_of(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(path: Path, node: ast.AST) -> list[str]:
    """The absolute module names an import node names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        head = ".".join(base + ([node.module] if node.module else []))
    else:
        head = node.module or ""
    return [head] + [f"{head}.{a.name}" for a in node.names]


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node → the name of the top-level function it is in."""
    owner = {}
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(top):
                owner[node] = top.name
    return owner


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def _allowed(path: Path, owner: dict, node: ast.AST) -> bool:
    return (path.name, owner.get(node)) in COMPOSITION and path.parent == PACKAGE


def test_no_core_module_imports_the_extension():
    found = []
    for path in core_modules():
        tree = ast.parse(path.read_text("utf-8"))
        owner = _functions(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported(path, node)
            if any(n == "hermes_service.mnote" or n.startswith("hermes_service.mnote.")
                   for n in names) and not _allowed(path, owner, node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                             f"imports {names[0]}")
    assert found == []


def test_the_composition_point_is_where_the_extension_is_imported():
    tree = ast.parse((PACKAGE / "installed.py").read_text("utf-8"))
    owner = _functions(tree)
    hits = [owner.get(node) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and "mnote" in _imported(PACKAGE / "installed.py", node)[0]]
    assert hits == ["extensions"]


def test_the_core_names_no_mnote_concept_in_code():
    found = []
    for path in core_modules():
        text = path.read_text("utf-8")
        tree = ast.parse(text)
        owner = _functions(tree)
        allowed_lines = {n.lineno for n in ast.walk(tree) if _allowed(path, owner, n)
                         and hasattr(n, "lineno")}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and "mnote" in tok.string.lower() \
                    and tok.start[0] not in allowed_lines:
                found.append(f"{path.name}:{tok.start[0]}: identifier {tok.string}")
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docs and MNOTE_NAME.match(node.value.strip()):
                found.append(f"{path.name}:{node.lineno}: string {node.value!r}")
    assert found == []


def test_the_rule_catches_what_it_forbids(tmp_path, monkeypatch):
    """The checks above see an import, an identifier and a name string of mnote."""
    core = tmp_path / "hermes_service"
    (core / "mnote").mkdir(parents=True)
    (core / "bad.py").write_text('from .mnote.runs import RunManager\n'
                                 'mnote_thing = 1\nENV = "MNOTE_RUN_FILE"\n', "utf-8")
    monkeypatch.setitem(globals(), "PACKAGE", core)
    monkeypatch.setitem(globals(), "EXTENSION", core / "mnote")
    for check in (test_no_core_module_imports_the_extension,
                  test_the_core_names_no_mnote_concept_in_code):
        try:
            check()
        except AssertionError as exc:
            assert "bad.py" in str(exc)
        else:
            raise AssertionError(f"{check.__name__} missed bad.py")

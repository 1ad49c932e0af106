"""Each subsystem folder imports only what its package docstring allows (docs/architecture.md).

A folder's ``__init__.py`` says what it owns and, in a sentence starting ``It may import``,
what it may import; :data:`MAY_IMPORT` is that list as names: other folders
(``sandbox.net``) and modules directly in ``hermes_service/`` (``errors``). Every import of
every module of the folder counts (type-only and function-level ones too, as in
``test_layers_imports.py``); imports inside the folder and its subfolders are free, except
that a subfolder listed here is held to its own list.
"""
from __future__ import annotations

import ast

from unit.test_layers_imports import ROOT, graph

#: folder (dotted, under hermes_service) → what its modules may import outside it
MAY_IMPORT = {
    "web": {"config", "conversations", "errors", "idempotency", "logs", "metrics", "preflight",
            "runner", "security", "service_objects", "storage"},
    "homes": {"config", "disk", "errors", "homefs", "json_cost", "sandbox"},
    "sandbox": {"config_fields", "homefs", "model_proxy"},     # model_proxy: a type only
    "sandbox.net": {"hermes_site", "instance", "metrics"},
    "disk": {"errors", "instance", "sandbox"},
    "model_proxy": {"embedded_http", "errors", "json_cost", "metrics", "storage"},
    "mnote.kernel": {"mnote"},
    "storage": {"config", "disk", "errors", "homefs", "homes", "idempotency", "instance",
                "model_proxy", "session_store"},
    "mnote.runs": {"errors", "instance", "limits", "logs", "mnote", "storage"},
    "openai_api": {"config", "config_fields", "conversations", "errors", "extensions", "homes",
                   "model_proxy", "runner", "service_objects", "web"},
}
PACKAGE = "hermes_service"


def owner(module: str, folders) -> str:
    """The folder of :data:`MAY_IMPORT` (deepest first) or the top-level module or folder
    ``module`` belongs to."""
    rel = module.removeprefix(PACKAGE).lstrip(".")
    for folder in sorted(folders, key=len, reverse=True):
        if rel == folder or rel.startswith(folder + "."):
            return folder
    return rel.split(".")[0]


def outside_imports(edges: dict[str, set[str]], folders) -> dict[str, set[str]]:
    """For each folder, what its modules import outside it, as owners."""
    out: dict[str, set[str]] = {f: set() for f in folders}
    for module, targets in edges.items():
        mine = owner(module, folders)
        if mine not in out:
            continue
        for target in targets:
            theirs = owner(target, folders)
            if theirs != mine and not theirs.startswith(mine + "."):
                out[mine].add(theirs)
    return out


def test_each_folder_imports_only_what_its_docstring_allows():
    found = outside_imports(graph(), MAY_IMPORT)
    extra = {f: sorted(found[f] - allowed) for f, allowed in MAY_IMPORT.items()
             if found[f] - allowed}
    assert extra == {}


def test_each_folder_says_what_it_owns_and_may_import():
    for folder in MAY_IMPORT:
        init = ROOT.joinpath(*folder.split("."), "__init__.py")
        doc = ast.get_docstring(ast.parse(init.read_text("utf-8"))) or ""
        assert "It may import" in doc, f"{init}: no 'It may import' sentence"


def test_no_package_init_hands_on_names_of_another_folder():
    """A folder's ``__init__`` imports nothing from outside the folder (a re-export would make
    the folder look as if it owned those names, and pull the other folder in with it)."""
    edges = graph()
    found = []
    for rel in MAY_IMPORT:
        module = f"{PACKAGE}.{rel}"
        for target in edges[module]:
            trel = target.removeprefix(PACKAGE).lstrip(".")
            if rel and not (trel == rel or trel.startswith(rel + ".")):
                found.append(f"{module} -> {target}")
    assert found == []


def test_the_rule_catches_a_forbidden_import():
    edges = {"hermes_service.disk.quota": {"hermes_service.web.helpers",
                                           "hermes_service.disk.use",
                                           "hermes_service.errors"},
             "hermes_service.sandbox.launcher": {"hermes_service.sandbox.net.sockets"},
             "hermes_service.sandbox.net.sockets": {"hermes_service.sandbox.args"}}
    found = outside_imports(edges, MAY_IMPORT)
    assert found["disk"] == {"web", "errors"}
    assert found["sandbox"] == set()                    # a subfolder of its own
    assert found["sandbox.net"] == {"sandbox"}          # held to its own list

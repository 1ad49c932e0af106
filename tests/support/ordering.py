"""The order ``make test`` hands tests to its two xdist workers (docs/testing.md §Time).

The suite is CPU-bound on two cores, so its wall time is about its CPU work over two — unless a
long test starts last and leaves one core idle. Longest first ("longest processing time first")
packs the two workers tightly: the long end-to-end tests start at once and the ~1 000 short
unit tests fill the gaps at the end. xdist (``--dist loadgroup --no-loadscope-reorder``, see
pytest.ini) hands out work units in the order of the collected items, so this reorders them:

* a work unit is one test, or every test of an ``xdist_group`` (which one worker runs in
  order), or every test of a module or class whose tests share a module- or class-scoped
  fixture (a service, a server, generated clients): such a module is one group here, so its
  fixture is set up once, on one worker, not once on each. The unit is given to xdist as
  the ``@group`` suffix of the node ids, which its scheduler reads;
* units run longest first by the seconds in :data:`COSTS_FILE` (``tests/support/costs.json``:
  node id → seconds of a ``make test`` run: every end-to-end test, the others of at least a
  second), a test not
  listed costing :data:`DEFAULT_E2E` seconds if it is in ``tests/e2e`` and
  :data:`DEFAULT_UNIT` otherwise; ties keep the collection order.

The order only changes which worker runs what and when; each test still gets its own
fixtures. Refresh the costs after adding slow tests: ``make test PYTEST_ARGS=--junitxml=
build/junit.xml`` then ``.venv/bin/python tests/support/ordering.py build/junit.xml``.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COSTS_FILE = Path(__file__).with_name("costs.json")
DEFAULT_E2E = 4.0       # seconds: about one CLI turn and a service start
DEFAULT_UNIT = 0.1
SHARED_SCOPES = ("module", "class")


def load_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    """``{node id: seconds}`` (node ids without xdist's ``@group`` suffix); {} if missing."""
    try:
        return json.loads(path.read_text("utf-8"))["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def _group(item) -> str | None:
    """The item's ``xdist_group`` name, if it has one."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return None


def _shared_scope(item) -> str | None:
    """``module`` or ``class`` when the item uses a fixture of that scope (set up once for its
    module or class), else None."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {defs[-1].scope for defs in (info.name2fixturedefs.values() if info else ()) if defs}
    for scope in SHARED_SCOPES:
        if scope in scopes:
            return scope
    return None


def _unit_key(item) -> str:
    """The work unit an item belongs to; gives a module (class) sharing a fixture a group."""
    group = _group(item)
    if group is not None:
        return "group:" + group
    scope = _shared_scope(item)
    if scope is None:
        return "test:" + item.nodeid
    path = item.nodeid.split("::")[0]
    name = path if scope == "module" or item.cls is None else f"{path}::{item.cls.__name__}"
    return "group:" + name


def cost(nodeid: str, costs: dict[str, float]) -> float:
    if nodeid in costs:
        return costs[nodeid]
    return DEFAULT_E2E if nodeid.startswith("tests/e2e/") else DEFAULT_UNIT


def order(items: list, costs: dict[str, float] | None = None) -> None:
    """Reorder ``items`` in place: work units longest first, each unit's tests together in
    their collection order."""
    costs = load_costs() if costs is None else costs
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit_key(item), []).append(item)
    total = {key: sum(cost(i.nodeid, costs) for i in members) for key, members in units.items()}
    ranked = sorted(units, key=lambda key: -total[key])     # stable: ties keep collection order
    items[:] = [item for key in ranked for item in units[key]]
    for key in ranked:
        if key.startswith("group:"):
            for item in units[key]:
                _join(item, key[len("group:"):])


def _join(item, group: str) -> None:
    """Put ``item`` into xdist work unit ``group``: xdist's scheduler groups by the node id's
    ``@group`` suffix. xdist 3.8's own worker hook sets that suffix on ``item._nodeid``,
    which pytest 9 no longer reads (a node id is the structured ``item._id``), so with
    pytest 9 every ``xdist_group`` was handed out test by test: both workers set up
    test_e2e_answers.py's service of each runner. Here the suffix is set where pytest 9
    reads it (and on ``_nodeid`` for an older pytest)."""
    if item.nodeid.endswith("@" + group):
        return
    nodeid = f"{item.nodeid}@{group}"
    current = getattr(item, "_id", None)
    if current is not None and hasattr(type(current), "parse"):
        item._id = type(current).parse(nodeid)
    else:
        item._nodeid = nodeid


def costs_from_junit(path: Path, at_least: float = 1.0) -> dict[str, float]:
    """``{node id: seconds}`` of a JUnit XML report's tests: every end-to-end test, and the
    others that took ``at_least`` seconds."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time", 0))
        if seconds < at_least and not case.get("classname", "").startswith("tests.e2e."):
            continue
        module = case.get("classname", "").replace(".", "/")
        parts = module.split("/")
        # classname is "tests.e2e.test_x" or "tests.e2e.test_x.TestClass"
        for cut in range(len(parts), 0, -1):
            if Path(*parts[:cut]).with_suffix(".py").exists():
                nodeid = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name")])
                break
        else:
            continue
        out[_without_group(nodeid)] = round(seconds, 1)
    return out


def _without_group(nodeid: str) -> str:
    """The node id without xdist's ``@group`` suffix (a report may show ``x[p]@g]``)."""
    base = nodeid.split("@")[0]
    return base + "]" if base.count("[") > base.count("]") else base


if __name__ == "__main__":      # tests/support/ordering.py JUNIT.xml...: rewrite costs.json
    seconds = {k: v for arg in sys.argv[1:] for k, v in costs_from_junit(Path(arg)).items()}
    COSTS_FILE.write_text(json.dumps({
        "about": "seconds per test of a make test run (written by tests/support/ordering.py)",
        "seconds": dict(sorted(seconds.items()))}, indent=1, ensure_ascii=False) + "\n", "utf-8")
    print(f"{len(seconds)} tests written to {COSTS_FILE}")

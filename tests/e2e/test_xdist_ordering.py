"""The order and the work units ``make test`` gives its xdist workers (tests/support/ordering.py,
docs/testing.md §Time and order), checked on a small suite run by the pinned pytest + xdist:
a group runs on one worker (its shared fixture set up once), longest work first."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from support.ordering import order

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        order(items, {{"test_long.py::test_long": 5.0}})
"""

RECORD = """
import json, os, time
from pathlib import Path

def record(name):
    with open(Path(__file__).with_name("ran.jsonl"), "a") as f:
        f.write(json.dumps({"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"],
                            "at": time.monotonic()}) + "\\n")
"""

GROUPED = """
import pytest
from record import record

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    record(f"grouped{n}")
"""

SHARED = """
import pytest
from record import record

@pytest.fixture(scope="module")
def server():
    record("setup")
    return object()

@pytest.mark.parametrize("n", range(6))
def test_shared(server, n):
    record(f"shared{n}")
"""

LONG = """
from record import record

def test_long():
    record("long")
"""


def test_groups_stay_on_one_worker_and_long_work_goes_first(tmp_path):
    for name, text in {"conftest.py": CONFTEST, "record.py": RECORD, "test_grouped.py": GROUPED,
                       "test_shared.py": SHARED, "test_long.py": LONG}.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    for n in range(8):      # short single tests that could fill either worker
        (tmp_path / f"test_single{n}.py").write_text(
            f"from record import record\n\ndef test_single():\n    record('single{n}')\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "-p", "no:cacheprovider", "-p", "no:schemathesis",
         str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ran = [json.loads(line) for line in (tmp_path / "ran.jsonl").read_text().splitlines()]
    workers = {}
    for entry in ran:
        workers.setdefault(entry["test"].rstrip("0123456789"), set()).add(entry["worker"])
    assert len(workers["grouped"]) == 1, ran          # an xdist_group: one worker
    assert len(workers["shared"]) == 1, ran           # a module sharing a fixture: one unit
    assert [e["test"] for e in ran].count("setup") == 1, ran
    first = {}
    for entry in sorted(ran, key=lambda e: e["at"]):
        first.setdefault(entry["worker"], entry["test"])
    # the longest unit (5 s by its cost) is the first thing one of the workers runs
    assert "long" in first.values(), ran

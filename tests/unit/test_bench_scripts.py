"""The benchmarks (``bench/*.py``, docs/benchmarks.md) still load: they import the test
helpers (``tests/support``) and the package, and nothing in ``make test`` runs them, so a
moved helper would otherwise break ``make bench`` unnoticed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# each script as a module (not __main__: its benchmark does not run), then its entry point
LOAD = """
import importlib.util, sys
for path in sys.argv[1:]:
    name = "bench_" + path.rsplit("/", 1)[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path}: no main()"
    print("loaded", path)
"""


def test_every_benchmark_script_loads():
    scripts = sorted(str(p) for p in (ROOT / "bench").glob("*.py"))
    assert scripts
    res = subprocess.run([sys.executable, "-c", LOAD, *scripts], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("loaded ") == len(scripts)

"""What the machine offers (hermes_service/machine.py), read from a made-up /proc and cgroup
tree: the cores (affinity, capped by cpu.max), the memory (MemTotal, capped by every
memory.max up the tree), and what is available now."""
from __future__ import annotations

import os

from hermes_service import machine


def fake(tmp_path, meminfo: str, cgroup: dict[str, dict[str, str]], rel="/svc/inner"):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(f"0::{rel}\n")
    for folder, files in cgroup.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / folder / name).write_text(text)
    return proc, root


MEMINFO = "MemTotal:       25165824 kB\nMemFree: 1 kB\nMemAvailable:   20971520 kB\n"


def test_no_cgroup_limit_reads_meminfo_and_the_affinity(tmp_path):
    proc, root = fake(tmp_path, MEMINFO, {"svc/inner": {"memory.max": "max\n"}})
    m = machine.probe(proc, root)
    assert (m.cores, m.memory_mb, m.memory_source) == \
        (len(os.sched_getaffinity(0)), 24576, "meminfo")
    assert machine.available_mb(proc, root) == 20480


def test_the_lowest_cgroup_limit_up_the_tree_counts(tmp_path):
    proc, root = fake(tmp_path, MEMINFO, {
        "svc": {"memory.max": str(4096 * machine.MIB), "cpu.max": "50000 100000\n",
                "memory.current": str(3072 * machine.MIB)},
        "svc/inner": {"memory.max": str(8192 * machine.MIB), "cpu.max": "max 100000\n",
                      "memory.current": str(3000 * machine.MIB)}})
    m = machine.probe(proc, root)
    assert m.memory_mb == 4096 and m.memory_source.endswith("svc")
    assert m.cores == 1                              # half a CPU's quota: at least one
    assert machine.available_mb(proc, root) == 1024  # 4096 - 3072 left under the parent


def test_unreadable_files_count_as_no_limit(tmp_path):
    proc, root = fake(tmp_path, "", {})
    m = machine.probe(proc, root)
    assert m.memory_mb == 1024 and m.cores >= 1      # the fallback, never an error
    assert machine.available_mb(proc, root) is None

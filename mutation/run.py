"""Mutation testing of the security- and durability-critical code (docs/testing.md §Mutation
testing). Run by ``make mutation``; not part of ``make test`` or CI (~35 min on the shared
2-core machine).

Two parts, run one after the other (never two mutation runs at once):

1. **mutmut** (pinned in requirements-dev.txt) over each module of :data:`MODULES`, one module
   at a time, each in its own scratch copy of the work tree (``build/mutation/<module>/``, so
   the work tree itself is never touched) and each against its own focused selection of fast
   unit tests (no CLI turn: ``HERMES_BIN`` is a stand-in that refuses to answer a turn).
   mutmut runs, for every mutant, only the selected tests that executed the mutated function.
   Every survivor must be explained in :data:`SURVIVORS` (``mutation/survivors.tsv``, matched
   by module, function and the mutated line); an unexplained survivor fails the run.
2. **Hand-made mutants** (:mod:`mutation.hand_mutants`): one-line changes mutmut cannot make
   (it skips decorated functions: Flask routes, context managers), the survivors a review
   found with hand-made mutations, and the one-line slips of each security- or
   durability-critical module group (:mod:`mutation.rules`). Each must make its tests fail,
   or be listed in :data:`SURVIVORS` as module ``hand:<group>`` with why.

Output: one line per module (mutants, killed, survived, timeout, explained survivors), the
diff of every unexplained survivor, the hand mutants' verdicts, and
``build/mutation/summary.json``. Exit status 0 when nothing survives unexplained, else 1.

Usage: ``python mutation/run.py [MODULE ...] [--no-hand] [--hand-only] [--max-children N]
[--group GROUP ...] [--resume LOG]`` (MODULE: a key of :data:`MODULES`; default all; GROUP: a
module group of the hand mutants, :mod:`mutation.rules`, which implies ``--hand-only``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mutation"
SURVIVORS = Path(__file__).resolve().parent / "survivors.tsv"   # the explained survivors
PYTHON = sys.executable
if str(ROOT) not in sys.path:          # mutation.* when run as a script
    sys.path.insert(0, str(ROOT))

#: Replaces the hermes CLI in mutation runs: a unit test that starts a real CLI turn fails
#: loudly instead of slowing every mutant down (the selections run no CLI).
STAND_IN_HERMES = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Hermes Agent v0.0.0 (mutation stand-in)"; exit 0; fi
echo "mutation runs start no CLI turn (mutation/run.py): $*" >&2
exit 97
"""

# pytest options for every run: no end-to-end test, no cache files in the copy.
PYTEST_ARGS = ["-m", "not e2e", "-p", "no:cacheprovider"]


@dataclass
class Module:
    """One module under mutation: ``path`` (repo-relative), ``tests`` (pytest arguments
    selecting its focused tests: files, node ids, ``--deselect``), ``functions`` (fnmatch
    patterns of the mangled function names to mutate, e.g. ``xǁGuardǁ*``; default all)."""
    path: str
    tests: list[str]
    functions: list[str] = field(default_factory=lambda: ["*"])

    @property
    def dotted(self) -> str:
        return self.path[:-3].replace("/", ".")


# The selections (docs/testing.md §Mutation testing): the unit tests that exercise each module,
# without tests that start service processes (covered by the fast suite; seconds per mutant).
_GC_COMMAND = "tests/unit/test_retention.py::test_gc_command"
_STORE = "tests/unit/test_session_store.py::"
MODULES: dict[str, Module] = {
    "security": Module("hermes_service/security.py", [
        "tests/unit/test_security.py", "tests/unit/web/test_scopes_health.py"]),
    "hooks": Module("hermes_service/web/hooks.py", [
        "tests/unit/test_security.py", "tests/unit/web/test_scopes_health.py",
        "tests/unit/mnote/test_tool_endpoint.py"],
        # authentication, scope and loopback; not the request id or access log
        functions=["x_is_loopback", "x_resolve_client", "x_authenticate"]),
    # the route families: which family a route or path is in, and what it asks
    "routing": Module("hermes_service/web/routing.py", [
        "tests/unit/web/test_routing.py", "tests/unit/web/test_scopes_health.py",
        "tests/unit/test_security.py", "tests/unit/mnote/test_tool_endpoint.py"]),
    "session_store": Module("hermes_service/session_store.py", [
        "tests/unit/test_session_store.py", "tests/unit/test_retention.py",
        "--deselect", _GC_COMMAND,
        "--deselect", _STORE + "test_kill_9_at_random_moments_of_a_migration_loses_nothing",
        "--deselect", _STORE + "test_service_refuses_to_start_on_a_corrupt_legacy_file"]),
    # the one atomic-write rule (temp file, fsync, rename, folder fsync): the registry's tests
    # kill a writer mid-write, count its fsyncs and make a write fail
    "files": Module("hermes_service/files.py", [
        "tests/unit/test_files.py", "tests/unit/test_session_store.py",
        "-k", "killed_inside or durable_before or failed_shard_write or roundtrip or format_utf8"]),
    "gateway": Module("hermes_service/mnote/gateway.py", [
        "tests/unit/mnote/test_tool_endpoint.py"]),
    "endpoint": Module("hermes_service/mnote/endpoint.py", [
        "tests/unit/mnote/test_tool_endpoint.py"],
        # the envelope and its codes; not _schema (the API document's copy of the contract
        # schemas, tests/unit/web/test_openapi.py); the route is decorated: hand mutants
        functions=["x_failure_envelope", "x_render_error_body", "x_tool_code"]),
    "page_store": Module("hermes_service/mnote/page_sqlite.py", [
        "tests/unit/mnote/test_page_store.py", "tests/unit/mnote/test_tools.py",
        "tests/unit/mnote/test_tool_endpoint.py", "tests/unit/test_retention.py",
        "--deselect", _GC_COMMAND,
        # isinstance() against the typing.Protocol fails on mutmut's copy (its trampolines add
        # members to the protocol class): a tool artefact, not a finding
        "--deselect", "tests/unit/mnote/test_page_store.py::test_is_a_page_store_with_wal"],
        # permissions (member, read, write, protectEditing, artifact write; options AI may
        # not change) and idempotency (lookup, conflict, replay, record, retry window)
        functions=["xǁSQLitePageStoreǁauthorize", "xǁSQLitePageStoreǁwrite_command",
                   "xǁSQLitePageStoreǁupdate_options", "xǁSQLitePageStoreǁprune_idempotency"]),
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          None: "not checked"}


def _copy_tree(dest: Path) -> None:
    """The work tree's files (tracked and new, not ignored) into ``dest``, afresh."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _setup_cfg(module: Module, dest: Path) -> None:
    lines = ["[mutmut]", "source_paths = hermes_service", f"only_mutate = {module.path}",
             "pytest_add_cli_args_test_selection ="]
    lines += [f"    {a}" for a in module.tests]
    lines += ["pytest_add_cli_args ="] + [f"    {a}" for a in PYTEST_ARGS]
    lines += ["also_copy ="] + [f"    {p}" for p in ("pytest.ini", "main.py", "config.yaml",
                                                    "users_template/", "examples/")]
    # log calls are not mutated: their text is not behaviour (docs/testing.md §Mutation testing)
    lines += ["do_not_mutate_patterns =", r"    ^\s*(log|logger|access_logger)\.(debug|info|warning|error|exception)\("]
    # never ask git which files changed: every run is fresh
    lines += ["use_git_change_detection = false", "use_setproctitle = false", ""]
    (dest / "setup.cfg").write_text("\n".join(lines))


def _env(dest: Path) -> dict:
    stand_in = dest / "stand-in-bin" / "hermes"
    stand_in.parent.mkdir(exist_ok=True)
    stand_in.write_text(STAND_IN_HERMES)
    stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MUTANT_UNDER_TEST", "PYTEST_ADDOPTS")}
    env["HERMES_BIN"] = str(stand_in)
    return env


def _results(dest: Path, module: Module) -> dict[str, str]:
    meta = json.loads((dest / "mutants" / (module.path + ".meta")).read_text())
    out = {}
    for name, code in meta["exit_code_by_key"].items():
        func = name.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
        if any(fnmatch(func, pat) for pat in module.functions):
            out[name] = STATUS.get(code, f"suspicious (exit {code})")
    return out


_DIFF = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({n: get_diff_for_mutant(n, path=sys.argv[1]) for n in sys.argv[2:]}))
"""


def _diffs(dest: Path, module: Module, names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = subprocess.run([PYTHON, "-c", _DIFF, module.path, *names], cwd=dest, check=True,
                         capture_output=True, text=True, env=_env(dest))
    return json.loads(out.stdout.strip().splitlines()[-1])


def function_of(mutant: str) -> str:
    """``hermes_service.security.xǁGuardǁcheck_key__mutmut_3`` → ``Guard.check_key``."""
    func = mutant.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    return func[2:] if func.startswith("x_") else ".".join(func.split("ǁ")[1:])


def mutated_lines(diff: str) -> str:
    """The changed lines of a mutant's diff, after the change, whitespace-trimmed, ``⏎``-joined."""
    return " ⏎ ".join(line[1:].strip() for line in diff.splitlines()
                      if line.startswith("+") and not line.startswith("+++"))


def explained_survivors(path: Path = SURVIVORS) -> dict[tuple[str, str, str], str]:
    """The explained survivors of :data:`SURVIVORS`: (module, function, mutated line) → reason.

    One tab-separated row per survivor after the header row ``module  function  mutated line
    why it survives``; lines starting with ``#`` are comments. A row with another number of
    fields raises :class:`ValueError` naming its line."""
    out = {}
    lines = path.read_text("utf-8").splitlines()
    rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip() and not line.startswith("#")]
    for n, line in rows[1:]:
        cells = line.split("\t")
        if len(cells) != 4:
            raise ValueError(f"{path}:{n}: {len(cells)} tab-separated fields, not 4")
        mod, func, mutated, reason = (c.strip() for c in cells)
        out[(mod, func, mutated)] = reason
    return out


def run_module(key: str, module: Module, max_children: int) -> dict:
    dest = BUILD / key
    print(f"== {key}: {module.path} (tests: {' '.join(module.tests)})", flush=True)
    started = time.monotonic()
    _copy_tree(dest)
    _setup_cfg(module, dest)
    globs = [f"{module.dotted}.{f}__mutmut_*" for f in module.functions]
    log = dest / "mutmut.log"
    with open(log, "w") as fh:
        proc = subprocess.run([PYTHON, "-m", "mutmut", "run", "--max-children", str(max_children),
                               *globs], cwd=dest, env=_env(dest), stdout=fh, stderr=subprocess.STDOUT)
    seconds = round(time.monotonic() - started)
    if not (dest / "mutants" / (module.path + ".meta")).exists():
        print(f"   mutmut failed (exit {proc.returncode}); see {log}")
        return {"module": key, "error": f"mutmut exit {proc.returncode}", "seconds": seconds}
    results = _results(dest, module)
    counts: dict[str, int] = {}
    for status in results.values():
        counts[status] = counts.get(status, 0) + 1
    survivors = sorted(n for n, s in results.items() if s == "survived")
    diffs = _diffs(dest, module, survivors)
    explained = explained_survivors()
    unexplained, reasons = [], {}
    for name in survivors:
        entry = (key, function_of(name), mutated_lines(diffs[name]))
        if entry in explained:
            reasons[name] = explained[entry]
        else:
            unexplained.append(name)
    print(f"   {len(results)} mutants: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
          + f"; {len(reasons)} survivor(s) explained in survivors.tsv, {len(unexplained)} not; {seconds} s",
          flush=True)
    for name in unexplained:
        print(f"   UNEXPLAINED {name}  [{key} | {function_of(name)} | {mutated_lines(diffs[name])}]")
        print("      " + diffs[name].replace("\n", "\n      "))
    bad = [n for n, s in results.items() if s not in ("killed", "survived", "timeout")]
    for name in bad:
        print(f"   {results[name].upper()} {name}")
    return {"module": key, "path": module.path, "tests": module.tests, "functions": module.functions,
            "counts": counts, "total": len(results), "seconds": seconds,
            "explained": {n: reasons[n] for n in reasons},
            "unexplained": {n: diffs[n] for n in unexplained}, "other": {n: results[n] for n in bad}}


def hand_groups() -> list[str]:
    from mutation.hand_mutants import groups
    return groups()


def kill_rates(hand: list[dict]) -> dict[str, dict]:
    """Per module group of the hand mutants' verdicts: mutants, killed, rate, seconds."""
    out: dict[str, dict] = {}
    for h in hand:
        r = out.setdefault(h["group"], {"mutants": 0, "killed": 0, "equivalent": 0,
                                        "seconds": 0.0})
        r["mutants"] += 1
        r["killed"] += bool(h["killed"])
        r["equivalent"] += bool(not h["killed"] and h.get("explained"))
        r["seconds"] = round(r["seconds"] + h.get("seconds", 0), 1)
    for r in out.values():
        r["rate"] = r["killed"] / r["mutants"]
        # the mutation score: of the mutants a test could tell from the original
        r["score"] = r["killed"] / max(1, r["mutants"] - r["equivalent"])
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", metavar="MODULE", help=", ".join(MODULES))
    ap.add_argument("--no-hand", action="store_true", help="skip the hand-made mutants")
    ap.add_argument("--hand-only", action="store_true", help="only the hand-made mutants")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (2)")
    ap.add_argument("--group", action="append", default=[], metavar="GROUP",
                    help="only the hand-made mutants of this module group (repeatable; "
                         "implies --hand-only): " + ", ".join(hand_groups()))
    ap.add_argument("--resume", action="append", default=[], metavar="LOG",
                    help="reuse the hand mutants' verdicts printed in LOG by a run cut short")
    args = ap.parse_args(argv)
    if args.group:
        args.hand_only = True
        for g in args.group:
            if g not in hand_groups():
                ap.error(f"unknown group {g!r}: one of {', '.join(hand_groups())}")
    for key in args.modules:
        if key not in MODULES:
            ap.error(f"unknown module {key!r}: one of {', '.join(MODULES)}")
    BUILD.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict = {"modules": [], "hand": []}
    ok = True
    if not args.hand_only:
        for key in args.modules or list(MODULES):
            res = run_module(key, MODULES[key], args.max_children)
            summary["modules"].append(res)
            ok &= not res.get("error") and not res["unexplained"] and not res["other"]
    if not args.no_hand and not args.modules:
        from mutation.hand_mutants import run_all, verdicts
        # a copy per selection of groups: two selections may run at once
        dest = BUILD / ("hand-" + "-".join(sorted(args.group)) if args.group else "hand")
        resume: dict[str, bool] = {}
        for log_path in args.resume:
            resume.update(verdicts(Path(log_path)))
        summary["hand"] = run_all(dest, _copy_tree, _env, args.group or None, resume)
        explained = explained_survivors()
        for h in summary["hand"]:
            # a hand mutant that survives is listed in survivors.tsv as module
            # ``hand:<group>``, function ``-``, its name as the mutated line
            h["explained"] = explained.get((f"hand:{h['group']}", "-", h["name"]))
            if not h["killed"] and not (h["explained"] and h["runs"]):
                ok = False
        summary["groups"] = kill_rates(summary["hand"])
        for g, r in summary["groups"].items():
            print(f"   {g}: {r['killed']}/{r['mutants']} killed ({r['rate']:.0%}); "
                  f"{r['equivalent']} explained survivor(s), score {r['score']:.0%}; "
                  f"{r['seconds']} s")
    summary["seconds"] = round(time.monotonic() - started)
    (BUILD / ("summary-" + "-".join(sorted(args.group)) + ".json" if args.group
             else "summary.json")).write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    print(f"== mutation testing {'passed' if ok else 'FAILED'} in {summary['seconds']} s "
          f"(summary: {BUILD / 'summary.json'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

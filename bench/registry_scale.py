"""Session registry at scale (docs/benchmarks.md): per-operation latency at 1 000 / 10 000 / 100 000
sessions over 1 000 users, in one process and with two processes writing at once.

For each size a registry is built the way an upgrade builds it — a single legacy
``data/sessions.json`` migrated on open (its time is printed too) — then, on random users
and sessions: ``create`` (a new mapping), ``update`` (the per-turn write:
hermes_session_id, message_count, last_run_at), ``get`` by id and ``list`` one user's
sessions; p50/p99 in ms. "2 writers" runs the same four in two processes started together
on the same data dir. ``gc pass`` is one cleanup pass with nothing stale (it reads every
shard and owner link). ``durable write floor`` is what the disk alone charges for one
durable replace of a file of the mean shard size (temp file, fsync, rename, folder fsync):
an update can not be cheaper, a create adds one folder fsync for its owner link. The
``(no fsync)`` rows repeat create and update with ``os.fsync`` switched off: the registry's
own work (lock, read, parse, encode, rename), i.e. what is left when the disk is fast.

With 1 000 users a larger registry also means more sessions per user; the per-user rows
hold that count fixed (100) while the total grows. The hot-user row is one user holding
many sessions: the cost that does grow (with that user's own count, which ``gc`` bounds).

    python3 bench/registry_scale.py [--sizes 1000,10000,100000] [--users 1000] [--ops 400]
    make bench-registry

Figures, not asserts: the machines are shared and noisy. Target: p99 <= 20 ms at 100 000.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hermes_service.session_store import SessionStore, now_iso  # noqa: E402

OPS = ("create", "update", "get", "list")
TARGET_P99_MS = 20.0
FLOOR = "durable write floor"


def record(i: int, user: str) -> dict:
    """A mapping as the mnote panel makes it (the larger of the two kinds)."""
    sid = f"mnote_doc_{i}_trace_{i:07d}.0123456789ab"
    return {"session_id": sid, "user_id": user, "kind": "mnote", "mnote_session_id": sid[:-13],
            "workspace_id": "ws_1", "document_id": f"doc_{i}", "title": "当前页问答",
            "trace_id": f"trace_{i:07d}", "hermes_session_id": f"20260101_000000_{i:06x}",
            "created_at": now_iso(), "updated_at": now_iso(), "status": "active",
            "message_count": 3, "last_run_at": now_iso(), "model": "hermes-agent"}


def build(data_dir: Path, sizes_by_user: dict[str, int]) -> tuple[list[str], float]:
    """Write a legacy sessions.json and migrate it; returns (session ids, migration seconds)."""
    sessions, i = {}, 0
    for user, n in sizes_by_user.items():
        for _ in range(n):
            rec = record(i, user)
            sessions[rec["session_id"]] = rec
            i += 1
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "sessions.json").write_text(json.dumps({"version": 1, "sessions": sessions}))
    started = time.perf_counter()
    SessionStore(data_dir)
    return list(sessions), time.perf_counter() - started


def measure(data_dir: Path, users: list[str], ids: list[str], ops: int, seed: int,
            tag: str) -> dict[str, list[float]]:
    """``ops`` of each operation on random users/sessions; seconds per call."""
    store, rng, out = SessionStore(data_dir), random.Random(seed), {op: [] for op in OPS}
    for k in range(ops):
        user = rng.choice(users)
        rec = {**record(0, user), "session_id": f"{tag}-{k}-{uuid.uuid4().hex[:8]}"}
        t = time.perf_counter()
        store.create(rec)
        out["create"].append(time.perf_counter() - t)
    for _ in range(ops):
        sid = rng.choice(ids)
        t = time.perf_counter()
        store.update(sid, hermes_session_id=f"20260102_000000_{rng.getrandbits(24):06x}",
                     message_count=rng.randrange(100), last_run_at=now_iso())
        out["update"].append(time.perf_counter() - t)
    for _ in range(ops):
        sid = rng.choice(ids)
        t = time.perf_counter()
        assert store.get(sid) is not None
        out["get"].append(time.perf_counter() - t)
    for _ in range(ops):
        user = rng.choice(users)
        t = time.perf_counter()
        store.list(user)
        out["list"].append(time.perf_counter() - t)
    return out


def worker(args) -> None:
    """One of the two concurrent writers: waits for the common start time, prints timings."""
    spec = json.loads(Path(args.worker).read_text())
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    print(json.dumps(measure(Path(spec["data_dir"]), spec["users"], spec["ids"], spec["ops"],
                             spec["seed"], spec["tag"])))


def two_writers(data_dir: Path, users: list[str], ids: list[str], ops: int) -> dict[str, list[float]]:
    procs = []
    start_at = time.time() + 2.0          # both have imported everything by then
    for n in (1, 2):
        spec = data_dir.parent / f"worker-{n}.json"
        spec.write_text(json.dumps({"data_dir": str(data_dir), "users": users, "ids": ids,
                                    "ops": ops, "seed": 100 + n, "tag": f"w{n}",
                                    "start_at": start_at}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(spec)],
                                      stdout=subprocess.PIPE, text=True))
    merged = {op: [] for op in OPS}
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"worker failed with exit {proc.returncode}")
        for op, times in json.loads(out).items():
            merged[op] += times
    return merged


def write_floor(folder: Path, size: int, ops: int) -> list[float]:
    """The least a durable replace of a ``size``-byte file costs here (temp file, write, fsync,
    rename, folder fsync), without any of the registry's own work; seconds per call."""
    folder.mkdir(parents=True, exist_ok=True)
    payload, out = b"x" * size, []
    for _ in range(ops):
        t = time.perf_counter()
        tmp = folder / f".floor.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, payload)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, folder / "floor.json")
        dfd = os.open(folder, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        out.append(time.perf_counter() - t)
    return out


def mean_shard_size(data_dir: Path) -> int:
    sizes = [p.stat().st_size for p in (data_dir / "sessions").glob("*/sessions.json")]
    return sum(sizes) // max(1, len(sizes))


def gc_pass(data_dir: Path) -> float:
    from hermes_service.installed import build_config
    from hermes_service.retention import collect
    from hermes_service.services import build_services
    svc = build_services(build_config({
        "security": {"enable_api_key": False}, "paths": {"data_dir": str(data_dir)}}))
    started = time.perf_counter()
    report = collect(svc, older_than=30 * 86400.0)
    elapsed = time.perf_counter() - started
    assert not report.counts["session mappings"], report.summary()
    return elapsed


def pct(times: list[float], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="registry sizes (sessions)")
    ap.add_argument("--users", type=int, default=1000, help="users the sessions spread over")
    ap.add_argument("--ops", type=int, default=400, help="calls per operation and size")
    ap.add_argument("--per-user", type=int, default=100,
                    help="sessions per user of the fixed-per-user rows (0: skip)")
    ap.add_argument("--hot-user", type=int, default=10000,
                    help="sessions of the one user of the hot-user row (0: skip)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    base = Path(args.dir or tempfile.mkdtemp(prefix="registry-bench-"))
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    extra: dict[str, dict[int, float]] = {"migrate (s)": {}, "gc pass (s)": {}}
    for n in sizes:
        work = base / f"n{n}"
        users = [f"user{u}" for u in range(min(args.users, n))]
        per_user = {u: n // len(users) + (1 if i < n % len(users) else 0) for i, u in enumerate(users)}
        print(f"building {n} sessions over {len(users)} users …", file=sys.stderr, flush=True)
        ids, migrate_s = build(work / "data", per_user)
        extra["migrate (s)"][n] = migrate_s
        one = measure(work / "data", users, ids, args.ops, seed=n, tag="m")
        floor = write_floor(work / "floor", mean_shard_size(work / "data"), args.ops)
        two = two_writers(work / "data", users, ids, args.ops)
        for op in OPS:
            rows.setdefault(op, {})[n] = (pct(one[op], 50), pct(one[op], 99))
            rows.setdefault(f"{op} (2 writers)", {})[n] = (pct(two[op], 50), pct(two[op], 99))
        rows.setdefault(FLOOR, {})[n] = (pct(floor, 50), pct(floor, 99))
        real_fsync, os.fsync = os.fsync, lambda fd: None    # the registry's own work only
        try:
            own = measure(work / "data", users, ids, args.ops, seed=n + 1, tag="o")
        finally:
            os.fsync = real_fsync
        for op in OPS:
            rows.setdefault(f"{op} (no fsync)", {})[n] = (pct(own[op], 50), pct(own[op], 99))
        extra["gc pass (s)"][n] = gc_pass(work / "data")
        shutil.rmtree(work, ignore_errors=True)

    order = [*OPS, *(f"{op} (2 writers)" for op in OPS), FLOOR,
             *(f"{op} (no fsync)" for op in ("create", "update"))]
    width = 22
    print(f"\nregistry scale: {args.users} users, {args.ops} calls per operation "
          f"(2 writers: {args.ops} each), p50 / p99 in ms")
    print(f"{'operation':<{width}}" + "".join(f"| {n:>9,} sessions  " for n in sizes)
          + f"| ratio {sizes[-1]:,}/{sizes[0]:,} p50, p99")
    for name in order:
        cells = "".join(f"| {rows[name][n][0]:7.2f} {rows[name][n][1]:8.2f}   " for n in sizes)
        lo, hi = rows[name][sizes[0]], rows[name][sizes[-1]]
        print(f"{name:<{width}}{cells}| {hi[0] / lo[0]:5.2f}, {hi[1] / lo[1]:5.2f}")
    for name, values in extra.items():
        cells = "".join(f"| {values[n]:16.2f}   " for n in sizes)
        print(f"{name:<{width}}{cells}| {values[sizes[-1]] / values[sizes[0]]:5.1f}")
    big = sizes[-1]
    worst = max(rows[name][big][1] for name in order if name != FLOOR and "fsync" not in name)
    print(f"\ntarget p99 <= {TARGET_P99_MS:g} ms at {big:,}: "
          + ("met" if worst <= TARGET_P99_MS else "NOT met") + f" (worst p99 {worst:.2f} ms)")

    if args.per_user:
        # the same number of sessions per user at every size: what grows is only the total
        print(f"\n{args.per_user} sessions per user at every size (single process), p50 / p99 ms")
        for n in sizes:
            if n == sizes[-1] and n // args.per_user == args.users:
                cells = rows                               # the main table's case
            else:
                work = base / f"fixed{n}"
                users = [f"user{u}" for u in range(max(1, n // args.per_user))]
                ids, _ = build(work / "data", {u: args.per_user for u in users})
                got = measure(work / "data", users, ids, args.ops, seed=n, tag="f")
                cells = {op: {n: (pct(got[op], 50), pct(got[op], 99))} for op in OPS}
                shutil.rmtree(work, ignore_errors=True)
            print(f"  {n:>9,} sessions ({max(1, n // args.per_user):,} users): " + ", ".join(
                f"{op} {cells[op][n][0]:.2f} / {cells[op][n][1]:.2f}" for op in OPS))

    if args.hot_user:
        work = base / "hot"
        print(f"building one user with {args.hot_user} sessions …", file=sys.stderr, flush=True)
        ids, _ = build(work / "data", {"hot": args.hot_user})
        hot = measure(work / "data", ["hot"], ids, max(50, args.ops // 4), seed=7, tag="h")
        print(f"one user with {args.hot_user:,} sessions (p50 / p99 ms): " + ", ".join(
            f"{op} {pct(hot[op], 50):.1f} / {pct(hot[op], 99):.1f}" for op in OPS))
        shutil.rmtree(work, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

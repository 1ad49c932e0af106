"""What a home snapshot costs per turn (hermes_service/storage/snapshots.py;
docs/data-and-durability.md §Home snapshots): save time after a small turn-like change, for
homes of 1 MB and 50 MB (a ``state.db`` of that size, written by Hermes's own ``SessionDB``
with its full-text indexes), full and incremental, side by side, against a real temporary
PostgreSQL (tests/support/postgres.py).

Per home size:

* ``full`` — the first save, into an empty database (every chunk uploaded);
* ``turn, warm`` — after a turn-like change (one session gets a user message and an answer,
  through ``SessionDB``), saved by the node that saved before (it remembers the hashes of
  unchanged files; ``state.db`` is always copied and hashed); ``its cpu``: the CPU time the
  saving process spent on it (the database's own not counted), less noisy on a loaded machine;
* ``turn, cold`` — the same change saved by a node that never saw the home (every file read
  and hashed; only the changed chunks uploaded);
* ``copy`` — the SQLite online backup of ``state.db`` alone (part of every save);
* ``restore`` — the latest manifest written into a fresh folder and swapped in;
* ``gc`` — one :func:`~hermes_service.storage.snapshots.collect_garbage` after the runs.

    .venv/bin/python bench/snapshot.py [--sizes 1 50] [--turns 5] [--compression lz4|pglz|none]

``--compression``: how PostgreSQL stores a chunk — ``lz4`` (the schema's choice where the
server has it), ``pglz`` (PostgreSQL's default), ``none`` (``SET STORAGE EXTERNAL``); the
bytes stored are printed. Figures (medians), not asserts: the machine is shared.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

HERMES_PY = ROOT / ".hermes-venv" / "bin" / "python"
MIB = 1024 * 1024

# runs under Hermes's own venv: its SessionDB writes state.db as a real turn does
HERMES = r"""
import random, sys
from pathlib import Path
from hermes_state import SessionDB
path, mb, seed = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
words = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 9)))
         for _ in range(3000)]
text = lambda n: ' '.join(rng.choice(words) for _ in range(n))
db = SessionDB(path)
if mb > 0:                              # fill: sessions of 10 exchanges until the size
    s = 0
    while path.stat().st_size < mb * 1024 * 1024:
        db.create_session(f"s{s}", "cli")
        for _ in range(10):
            db.append_message(f"s{s}", "user", text(40))
            db.append_message(f"s{s}", "assistant", text(250))
        s += 1
else:                                   # one turn on the first session
    db.append_message("s0", "user", text(40))
    db.append_message("s0", "assistant", text(250))
db.close()
"""


def hermes(path: Path, mb: float, seed: int) -> None:
    subprocess.run([str(HERMES_PY), "-c", HERMES, str(path), str(mb), str(seed)], check=True,
                   cwd=ROOT)


def make_home(base: Path, mb: float) -> Path:
    home = base / "users" / f"u{mb:g}"
    (home / ".hermes" / "skills").mkdir(parents=True)
    (home / ".hermes" / "config.yaml").write_text("model:\n  default: scripted\n")
    for i in range(20):
        (home / ".hermes" / "skills" / f"skill{i}.md").write_text("# skill\n" + "x" * 2000)
    (home / "notes.md").write_text("notes\n" * 100)
    hermes(home / ".hermes" / "state.db", mb, 1)
    return home


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 50])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--compression", choices=("lz4", "pglz", "none"), default="lz4")
    args = parser.parse_args()

    import psycopg

    from hermes_service.storage import snapshot_sqlite
    from hermes_service.storage.snapshot_schema import SCHEMA
    from hermes_service.storage.snapshots import HomeSnapshots, collect_garbage
    from support.postgres import PASSWORD, PostgresCluster

    cluster = PostgresCluster()
    base = Path(tempfile.mkdtemp(prefix="bench-snapshot-"))
    rows, ratios = [], []
    try:
        conn = psycopg.connect(cluster.url(cluster.create_database("bench")), password=PASSWORD)
        for sql in SCHEMA:
            conn.execute(sql)
        if args.compression == "none":
            conn.execute("ALTER TABLE home_chunks ALTER COLUMN data SET STORAGE EXTERNAL")
        elif args.compression == "pglz":
            conn.execute("ALTER TABLE home_chunks ALTER COLUMN data SET COMPRESSION pglz")
        conn.commit()
        for mb in args.sizes:
            home = make_home(base, mb)
            user = home.name
            size = sum(p.stat().st_size for p in home.rglob("*") if p.is_file())

            def save(snaps: HomeSnapshots):
                t, c = time.perf_counter(), time.process_time()
                info = snaps.save(conn, user, home)
                conn.commit()
                cpu.append(time.process_time() - c)
                return time.perf_counter() - t, info

            warm = HomeSnapshots(2048 * MIB)
            cpu: list[float] = []
            full, first = save(warm)
            warm_t, warm_up, cold_t, cold_up, copy_t, warm_cpu = [], [], [], [], [], []
            for i in range(args.turns):
                hermes(home / ".hermes" / "state.db", 0, 100 + i)
                t, info = save(warm)
                warm_t.append(t)
                warm_cpu.append(cpu[-1])
                warm_up.append(info.chunks_uploaded)
                hermes(home / ".hermes" / "state.db", 0, 200 + i)
                t, info = save(HomeSnapshots(2048 * MIB))
                cold_t.append(t)
                cold_up.append(info.chunks_uploaded)
                dfd = os.open(home / ".hermes", os.O_RDONLY | os.O_DIRECTORY)
                out = base / "copy.db"
                t0 = time.perf_counter()
                snapshot_sqlite.backup(dfd, "state.db", out, 2048 * MIB, time.monotonic() + 60)
                copy_t.append(time.perf_counter() - t0)
                os.close(dfd)
                out.unlink()
            target = base / "users" / f"restored{mb:g}"
            t0 = time.perf_counter()
            HomeSnapshots(2048 * MIB).restore(conn, user, target)
            conn.commit()
            restore_t = time.perf_counter() - t0
            shutil.rmtree(target)
            stored = conn.execute("SELECT sum(octet_length(data)), sum(pg_column_size(data)) "
                                  "FROM home_chunks").fetchone()
            ratios.append(f"{stored[0] / MIB:.1f} MB of chunks stored in {stored[1] / MIB:.1f} MB")
            rows.append((f"{size / MIB:6.1f} MB", f"{full * 1000:8.1f}",
                         f"{first.chunks_uploaded:5d}", ms(warm_t),
                         f"{statistics.median(warm_up):4.0f}/{first.chunks_total}", ms(warm_cpu),
                         ms(cold_t), f"{statistics.median(cold_up):4.0f}", ms(copy_t),
                         f"{restore_t * 1000:8.1f}"))
        t0 = time.perf_counter()
        gone = collect_garbage(conn)
        conn.commit()
        gc_t = time.perf_counter() - t0
        conn.close()
    finally:
        cluster.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f}; chunk compression: {args.compression}; medians of {args.turns} turns; times in ms")
    head = ("home", "full", "chunks", "turn warm", "uploaded", "its cpu", "turn cold", "upl.",
            "copy", "restore")
    widths = (9, 8, 6, 9, 10, 8, 9, 5, 8, 8)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print("stored (cumulative): " + "; ".join(ratios))
    print(f"gc: {gone} unreferenced chunks deleted in {gc_t * 1000:.1f} ms")


if __name__ == "__main__":
    main()

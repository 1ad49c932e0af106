"""What a hostile ``state.db`` costs the service: peak memory (RSS) and time of transcript
reads through hermes_service.homes.state_db, next to the same read with SQLite unbounded (what the
service did before), side by side in one run.

Each case runs in a fresh child process (so its peak RSS, ``ru_maxrss``, is its own) that
reads the transcript ``--readers`` times at once (threads) and serialises each answer as the
route would (``json.dumps``). Homes:

* ``plain`` — a conversation of 40 turns (the baseline);
* ``generated`` — ``messages.content`` rebuilt as a generated column of 40 MiB per row (the
  attack of the issue: 825 MiB for one read, 1.9 GiB for three);
* ``big-rows`` — rows of 1 MiB each, 64 MiB in all (each value under the value limit);
* ``near-limit`` — 14 rows of 1 MiB: just under the read budget, served (the most a read
  that succeeds costs);
* ``huge-value`` — one row whose record claims a 1 GB text (tests/unit/homes/test_state_db.py
  ``claim_huge``).

    .venv/bin/python bench/state_db.py [--readers 3]

Figures, not asserts: the machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

CHILD = r"""
import json, resource, sqlite3, sys, threading, time
sys.path[:0] = [sys.argv[4], sys.argv[5]]
from hermes_service import hermes_state
home, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = []

def bounded():
    try:
        out.append(len(json.dumps(hermes_state.transcript(home, "s1"))))
    except Exception as exc:
        out.append(f"{getattr(exc, 'status', '')} {type(exc).__name__}")

def unbounded():
    try:
        db = sqlite3.connect(f"file:{home}/state.db?mode=ro", uri=True)
        rows = db.execute("SELECT id, role, content FROM messages WHERE session_id = 's1' "
                          "AND active = 1 ORDER BY id").fetchall()
        out.append(len(json.dumps([[r[0], r[1], r[2] if isinstance(r[2], str) else
                                    len(r[2] or b'')] for r in rows])))
    except Exception as exc:
        out.append(type(exc).__name__)

t0 = time.perf_counter()
threads = [threading.Thread(target=bounded if mode == "bounded" else unbounded) for _ in range(n)]
for t in threads: t.start()
for t in threads: t.join()
took = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"added_mib": round((peak - base) / 1024, 1), "seconds": round(took, 2),
                  "results": sorted(set(map(str, out)))}))
"""


def homes(tmp: Path) -> dict[str, Path]:
    from support.hermes_record import record_turn
    from unit.homes.test_state_db import claim_huge
    made = {}
    for name in ("plain", "generated", "big-rows", "near-limit", "huge-value"):
        home = tmp / name / ".hermes"
        for i in range(40 if name == "plain" else 1):
            record_turn(home, "s1", f"question {i}", answer=f"answer {i} " + "x" * 2000)
        db = sqlite3.connect(home / "state.db")
        if name == "generated":
            db.executescript(
                "ALTER TABLE messages RENAME COLUMN content TO real_content;"
                "ALTER TABLE messages ADD COLUMN content TEXT GENERATED ALWAYS AS "
                "(printf('%.*c', 41943040, 'x')) VIRTUAL;")
        elif name in ("big-rows", "near-limit"):
            db.executemany("INSERT INTO messages (session_id, role, content, timestamp) VALUES "
                           "('s1', 'assistant', printf('%.*c', 1048576, 'y'), ?)",
                           [(i,) for i in range(64 if name == "big-rows" else 14)])
            db.commit()
        db.close()
        if name == "huge-value":
            db = sqlite3.connect(home / "state.db")
            db.execute("DELETE FROM messages WHERE role = 'assistant'")
            db.commit()
            db.close()
            claim_huge(home / "state.db", 999_000_000)
        made[name] = home
    return made


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readers", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        made = homes(Path(tmp))
        print(f"transcript reads of a hostile state.db, {args.readers} at once "
              "(peak RSS added by the reads, MiB; wall time)")
        print(f"{'home':<12} {'bounded (state_db)':>34}   {'unbounded (plain sqlite3)':>34}")
        for name, home in made.items():
            row = []
            for mode in ("bounded", "unbounded"):
                res = subprocess.run([sys.executable, "-c", CHILD, str(home), mode,
                                      str(args.readers), str(ROOT), str(ROOT / "tests")],
                                     capture_output=True, text=True, timeout=600)
                try:
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    row.append(f"{got['added_mib']:>7} MiB {got['seconds']:>5} s "
                               f"{','.join(got['results'])[:14]:<14}")
                except (IndexError, ValueError):
                    row.append(f"failed: {res.stderr.strip()[-30:]}")
            print(f"{name:<12} {row[0]:>34}   {row[1]:>34}")


if __name__ == "__main__":
    main()

"""What a block batch costs on the embedded store against rewriting the page with page.save
(docs/mnote-tools.md §Block tools; docs/benchmarks.md §Block tools).

The tool executor (as the tool endpoint runs it) against the SQLite page store, for pages of
100, 1 000 and 5 000 paragraphs of ~80 characters:

* ``batch 1 update`` — ``mnote.block.batch`` changing one block (``baseRevision``);
* ``batch 100 ops`` — the most ops a batch may hold (updates of the first 100 blocks);
* ``page.save replace`` — the whole page rewritten with one block changed (what an agent
  had to do before; refused when the page is larger than an argument may be, 256 KiB);
* ``page.get`` — reading the page with its block hashes.

Per case: the median and the 10th-90th percentiles in ms.

    .venv/bin/python bench/block_batch.py [--calls N]

``--calls`` N (default 50) per case and page size. Figures, not asserts: the machines are
shared and noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from hermes_service.mnote.blocks import block_hash  # noqa: E402
from hermes_service.mnote.page_sqlite import SQLitePageStore  # noqa: E402
from hermes_service.mnote.tools import ToolExecutor  # noqa: E402

SIZES = (100, 1000, 5000)


def envelope(tool: str, args: dict, n: int) -> dict:
    return {"toolName": tool, "workspaceId": "ws_1", "documentId": "doc_1",
            "actorId": "user_1", "sessionId": "s", "runId": "r", "toolCallId": f"c{n}",
            "traceId": "t", "idempotencyKey": None if tool == "mnote.page.get" else f"k{n}",
            "dryRun": False, "capabilityScope": ["page.read", "page.write"], "args": args}


def measure(executor: ToolExecutor, make, calls: int) -> list[float] | str:
    """The calls' times in ms, or the refusal's message (a page too large for page.save)."""
    times = []
    for i in range(calls):
        env = make(i)
        started = time.perf_counter()
        out = executor.invoke(env)
        times.append((time.perf_counter() - started) * 1000)
        if not out["ok"]:
            return f"refused: {out['error']['message'][:70]}"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    calls = parser.parse_args().calls
    print(f"{'blocks':>6}  {'case':<18} {'median ms':>9}  {'p10-p90 ms':>14}")
    for size in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            store = SQLitePageStore(Path(tmp) / "mnote.db")
            store.add_workspace("ws_1")
            store.add_member("ws_1", "user_1", "owner")
            blocks = [{"id": f"b{i}", "type": "paragraph", "text": f"{i:05d} " + "文字" * 37}
                      for i in range(size)]
            store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "t",
                               "blocks": blocks})
            ex = ToolExecutor(store)
            counter = iter(range(10**9))

            def current() -> list[dict]:
                return store.export_page("doc_1")["blocks"]

            def one_update(i):
                b = current()[size // 2]
                return envelope("mnote.block.batch", {"baseRevision": 1, "ops": [
                    {"op": "update", "blockId": b["id"], "expectHash": block_hash(b),
                     "block": {"text": f"改 {i}"}}]}, next(counter))

            def hundred(i):
                page = current()
                return envelope("mnote.block.batch", {"baseRevision": 1, "ops": [
                    {"op": "update", "blockId": b["id"], "expectHash": block_hash(b),
                     "block": {"text": f"改 {i}"}} for b in page[:100]]}, next(counter))

            def replace(i):
                page = current()
                page[size // 2] = {**page[size // 2], "text": f"改 {i}"}
                return envelope("mnote.page.save", {"mode": "replace", "content": page},
                                next(counter))

            cases = {"batch 1 update": one_update, "batch 100 ops": hundred,
                     "page.save replace": replace,
                     "page.get": lambda i: envelope("mnote.page.get", {}, next(counter))}
            for name, make in cases.items():
                got = measure(ex, make, calls)
                if isinstance(got, str):
                    print(f"{size:>6}  {name:<18} {got}")
                    continue
                times = sorted(got)
                p10, p90 = times[len(times) // 10], times[len(times) * 9 // 10]
                print(f"{size:>6}  {name:<18} {statistics.median(times):>9.2f}  "
                      f"{p10:>6.2f}-{p90:<7.2f}")
            store.close()


if __name__ == "__main__":
    main()

"""The watcher of live sandboxes' disk use (docs/sandbox.md §Disk, §What the watcher counts):
one daemon thread per service process, asleep while no sandbox lives.

Every :data:`WATCH_SECONDS` it reads the free space of the data dir's and the homes' file
systems (:meth:`Rules.free_space`). It measures each sandbox's home and run folder
(:func:`~hermes_service.disk.use.usage`, plus the files its processes hold with no name left:
:func:`~hermes_service.disk.use.held_mb`) at most every :data:`WALK_EVERY` seconds and at
most ~1/:data:`WALK_SHARE` of the time — every one at once when the free space fell, since
all were last measured, by more than the tightest home's room. It ends (SIGKILL to every
process of the sandbox; :attr:`Launch.over` tells the runner why):

* a sandbox past its quota: ``home_quota``;
* below the floor, the sandbox that grew most in its turn (more than :data:`GROWTH_MB`),
  else the one writing fastest: ``disk``;
* when the file systems lost more than a quota, faster than :data:`GROWTH_MB` a second,
  that no measured growth explains (a leaky bucket: a slow drift never fills it; space freed
  before the walk that shows it is a credit of at most a quota), the sandbox writing
  fastest: ``home_quota``.

On btrfs with qgroups (``Rules.backend``) the kernel holds each quota; only the floor is
kept here.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..sandbox import Launch, descendants, signal_tree
from .btrfs import BTRFS
from .use import Usage, held_mb, usage, write_bytes

log = logging.getLogger("hermes_service.disk")

MIB = 1024 * 1024
#: how often the watcher looks at the free space (seconds)
WATCH_SECONDS = 0.05
#: a home is walked at most this often, and at most ~1/WALK_SHARE of the time
WALK_EVERY = 1.0
WALK_SHARE = 20
#: a sandbox is ended for a full file system only if it grew by more than this in its turn
#: (MiB), or writes faster than this per second; space lost unexplained slower than this per
#: second never ends one
GROWTH_MB = 16


class Rules(Protocol):
    """What the watcher reads of :class:`hermes_service.disk.quota.Disk`."""
    backend: str
    max_home_mb: float
    min_free: int

    @property
    def files_cap_mb(self) -> float: ...

    def free_space(self) -> list[tuple[str, int | None, bool]]:
        """``(label, free bytes or None, below the floor)`` of each file system."""
        ...


@dataclass
class Watched:
    """One live sandbox: its launch, home, run folder, use at its start and now."""
    launch: Launch
    user_id: str
    home: Path
    run_dir: Path
    start: Usage
    now: Usage
    next_walk: float = 0.0
    ended: bool = False
    devices: set[int] = field(default_factory=set)   # st_dev of the home and run folder
    written: tuple[float, int] | None = None   # (when, bytes its live processes had written)
    rate: float = 0.0              # bytes per second they wrote between the last two looks
    cost: float = 0.0              # seconds its last measure took

    def pids(self) -> list[int]:
        pid = self.launch.pid
        return [] if pid is None else [pid, *descendants(pid)]

    @property
    def grown_mb(self) -> float:
        return self.now.total_mb - self.start.total_mb


class Watcher:
    """The watched sandboxes of one service process and the thread that watches them."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self._lock = threading.Lock()
        self._watched: dict[int, Watched] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._low: dict[str, bool] = {}
        self._free: int | None = None              # free bytes at the last look
        self._free_walked: int | None = None       # ... when every home was last measured
        #: bytes the file systems lost that no watched sandbox's measured growth explains
        self._unexplained = 0.0
        self._looked = 0.0                         # monotonic time of the last look

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, launch: Launch, user_id: str, home_root: Path, run_dir: Path,
              used: Usage) -> None:
        """Watch ``launch``'s sandbox until it closes (:meth:`Launch.on_close`)."""
        w = Watched(launch, user_id, Path(home_root), Path(run_dir), used, used,
                    next_walk=time.monotonic() + WALK_EVERY)
        for path in (home_root, run_dir):
            try:
                w.devices.add(os.stat(path).st_dev)
            except OSError:
                pass
        key = id(launch)
        with self._lock:
            self._watched[key] = w
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="disk-watch",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

        def forget():
            with self._lock:
                self._watched.pop(key, None)
        launch.on_close(forget)

    def _loop(self) -> None:
        while True:
            with self._lock:
                watched = [w for w in self._watched.values() if not w.ended]
            if not watched:
                self._free, self._free_walked, self._unexplained = None, None, 0.0
                self._wake.wait(5.0)
                self._wake.clear()
                continue
            try:
                self.look(watched)
            except Exception:  # the watcher must not die
                log.exception("disk watcher")
            time.sleep(WATCH_SECONDS)

    def look(self, watched: list[Watched]) -> None:
        """One look (module doc)."""
        rules, quota = self.rules, self.rules.backend != BTRFS
        spaces = rules.free_space()
        low = [label for label, _, is_low in spaces if is_low]
        free = sum(b for _, b, _ in spaces if b is not None)
        now = time.monotonic()
        left = min((rules.files_cap_mb - w.now.files_mb for w in watched), default=0) * MIB
        drop = 0 if self._free is None else self._free - free
        if self._free_walked is None:
            self._free_walked = free
        rush = self._free_walked - free > max(left, 0)
        self._free = free
        if rush or low:
            self._free_walked = free
        explained = 0.0
        for w in watched:
            if low or (quota and (rush or now >= w.next_walk)):
                was = w.now.total_mb
                self.measure(w)
                explained += (w.now.total_mb - was) * MIB
                over = w.now.files_mb > rules.files_cap_mb or \
                    w.now.total_mb > rules.max_home_mb
                if over and quota:
                    self.end(w, "home_quota", f"its home uses {w.now.total_mb:.0f} MiB (files "
                             f"{w.now.files_mb:.0f}), over max_home_mb {rules.max_home_mb:g}")
        self._say_low(low)
        live = [w for w in watched if not w.ended]
        if low:
            self._end_grower(live, low[0])
        elif quota:      # a leaky bucket: a slow drift (logs, the host) never fills it
            leak = GROWTH_MB * MIB * max(0.0, now - self._looked) if self._looked else 0.0
            level = self._unexplained + drop - explained
            # files deleted show as free space at once and as a smaller home only at its next
            # walk: a credit (below 0, at most a quota) keeps that lag from reading as space
            # gone unseen; it drains toward 0 like the rest
            level = level - leak if level > 0 else min(0.0, level + leak)
            self._unexplained = max(-rules.max_home_mb * MIB, level)
        self._looked = now
        if not low and self._unexplained > rules.max_home_mb * MIB / 2:
            self._end_hider(live)

    def _say_low(self, low: list[str]) -> None:
        for label in low:
            if self._low.get(label) is not True:
                log.warning("disk: %s is below hermes.sandbox.min_free_mb (%d MiB); no turn "
                            "starts until there is room", label, self.rules.min_free // MIB)
            self._low[label] = True
        for label in list(self._low):
            if label not in low and self._low[label]:
                log.info("disk: %s has room again", label)
                self._low[label] = False

    def _sample_rates(self, live: list[Watched]) -> None:
        for w in live:
            now = (time.monotonic(), write_bytes(w.pids()))
            if w.written is not None and now[0] > w.written[0]:
                w.rate = max(0, now[1] - w.written[1]) / (now[0] - w.written[0])
            w.written = now

    @staticmethod
    def _fastest(live: list[Watched]) -> Watched | None:
        writing = [w for w in live if w.rate > GROWTH_MB * MIB]
        return max(writing, key=lambda w: w.rate) if writing else None

    def _end_hider(self, live: list[Watched]) -> None:
        """More than half a quota went unexplained: sample the write rates; past a whole
        quota, end the sandbox writing fastest and count again from 0."""
        self._sample_rates(live)
        top = self._fastest(live)
        if top is not None and self._unexplained > self.rules.max_home_mb * MIB:
            self.end(top, "home_quota", f"{self._unexplained / MIB:.0f} MiB went from the disk "
                     f"where no home shows it while its sandbox wrote fastest "
                     f"({top.rate / MIB:.0f} MiB/s)")
            self._unexplained = 0.0

    def _end_grower(self, live: list[Watched], where: str) -> None:
        """Below the floor: end the sandbox that grew most in its turn (more than
        :data:`GROWTH_MB`); with none, the one writing fastest (space held where neither
        walk nor ``/proc`` sees it still took writes to fill)."""
        self._sample_rates(live)
        grown = [w for w in live if w.grown_mb > GROWTH_MB]
        if grown:
            big = max(grown, key=lambda w: w.grown_mb)
            self.end(big, "disk", f"{where} is below the floor and its sandbox grew by "
                     f"{big.grown_mb:.0f} MiB in this turn")
            return
        top = self._fastest(live)
        if top is not None:
            self.end(top, "disk", f"{where} is below the floor, no home grew and its sandbox "
                     f"writes fastest ({top.rate / MIB:.0f} MiB/s)")

    def measure(self, w: Watched) -> None:
        """Walk ``w``'s home and run folder, add what its processes hold unnamed."""
        t0 = time.monotonic()
        walked = usage(w.home, w.run_dir, stop_above=self.rules.max_home_mb + 1)
        hidden = held_mb(w.pids(), w.devices) if w.devices else 0.0
        w.now = Usage(walked.files_mb + hidden, walked.state_mb)
        w.cost = time.monotonic() - t0
        w.next_walk = t0 + max(WALK_EVERY, WALK_SHARE * w.cost)

    @staticmethod
    def end(w: Watched, why: str, detail: str) -> None:
        """Stop the sandbox's writing at once (SIGKILL to every process in it: the runner,
        which polls every ~0.2 s, then ends the turn with the code of :attr:`Launch.over`)."""
        w.ended = True
        w.launch.over = why
        if w.launch.pid is not None:
            signal_tree(w.launch.pid, signal.SIGKILL)
        log.warning("disk: ended the sandbox of user=%s: %s", w.user_id, detail)

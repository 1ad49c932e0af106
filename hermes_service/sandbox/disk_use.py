"""What a home takes on disk, counted the way ``hermes.sandbox.max_home_mb`` counts it
(docs/sandbox.md §Disk)."""
from __future__ import annotations

import os
from pathlib import Path

#: What one file or folder counts at least toward ``max_home_mb`` (its inode): 200 000 empty
#: files are not free.
MIN_ENTRY_BYTES = 4096


def home_size_mb(root: Path, stop_above: float | None = None) -> float:
    """Disk use of a home in MiB: allocated blocks, each entry at least
    :data:`MIN_ENTRY_BYTES`; symlinks not followed; hard-linked files counted once; walked
    by folder descriptors (``os.fwalk``), so paths too long to name still count. Stops
    counting once above ``stop_above``."""
    seen: set = set()
    total = 0
    limit = None if stop_above is None else stop_above * 1024 * 1024
    try:
        walk = os.fwalk(str(root), follow_symlinks=False)
        for _dirpath, dirnames, filenames, dirfd in walk:
            for name in (*dirnames, *filenames):
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not dirnames.count(name):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
                if limit is not None and total > limit:
                    walk.close()  # type: ignore[attr-defined]
                    return total / 1024 / 1024
    except OSError:
        pass
    return total / 1024 / 1024

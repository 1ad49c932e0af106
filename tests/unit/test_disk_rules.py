"""The disk floor's edge (hermes_service/disk.py, docs/sandbox.md §Disk): a file system with
less free space than ``hermes.sandbox.min_free_mb`` refuses a turn, with more it does not —
at the floor itself, not at a fraction of it. The rest of the quota's rules:
test_disk.py."""
from __future__ import annotations

import pytest

from hermes_service import disk
from hermes_service.disk import Disk, Space
from hermes_service.errors import StorageFull
from hermes_service.sandbox import Settings

MIB = 1024 * 1024


def test_a_turn_is_refused_just_below_the_floor_and_taken_just_above(tmp_path, monkeypatch):
    home, run = tmp_path / "data" / "users" / "u", tmp_path / "data" / "runs" / "u"
    home.mkdir(parents=True)
    d = Disk(Settings(quota="watch", max_home_mb=32, min_free_mb=64),
             tmp_path / "data", tmp_path / "data" / "users")
    monkeypatch.setattr(disk, "space", lambda p: Space(63 * MIB, 10**6, 10**7))
    with pytest.raises(StorageFull):
        d.check_turn(home, run)
    monkeypatch.setattr(disk, "space", lambda p: Space(65 * MIB, 10**6, 10**7))
    assert d.check_turn(home, run).total_mb < 1

"""The operator's way out of a home at its quota (hermes_service/homes/trim.py; docs/sandbox.md
§A home at its quota): what takes the room, and removing what it is given — inside the home
only, never through what the agent planted, never Hermes's record. With a real image at its
quota: tests/unit/disk/test_image.py, tests/e2e/test_e2e_disk_image.py."""
from __future__ import annotations

import os

import pytest

from hermes_service.homes import trim as home_trim
from hermes_service.homes.trim import BadPath, largest, remove

MIB = 1024 * 1024


def test_the_largest_entries_are_listed_and_hermess_record_is_not(tmp_path):
    home = tmp_path / "u"
    (home / ".hermes").mkdir(parents=True)
    (home / ".hermes" / "state.db").write_bytes(b"\1" * 3 * MIB)
    (home / "build" / "obj").mkdir(parents=True)
    (home / "build" / "obj" / "a.o").write_bytes(b"\1" * 2 * MIB)
    (home / "big.bin").write_bytes(b"\1" * 4 * MIB)
    (home / "note").write_text("x")
    got = [e.path for e in largest(home)]
    assert got[:3] == ["big.bin", "build/", "build/obj/"] and "note" in got
    assert not any(p.startswith(".hermes") for p in got)
    assert len(largest(home, top=2)) == 2


def test_only_paths_inside_the_home_go_and_a_planted_symlink_is_removed_not_followed(tmp_path):
    home, outside = tmp_path / "u", tmp_path / "outside"
    (home / ".hermes").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep").write_text("the host's")
    os.symlink(outside, home / "link")                  # planted by the agent
    for bad in ("/etc/passwd", "../outside", "a/../../outside", "", ".", ".hermes",
                ".hermes/state.db"):
        with pytest.raises(BadPath):
            remove(home, bad)
    with pytest.raises(BadPath):                        # through the symlink: refused
        remove(home, "link/keep")
    assert remove(home, "link") and not os.path.lexists(home / "link")
    assert (outside / "keep").read_text() == "the host's"
    (home / "d" / "e").mkdir(parents=True)
    assert remove(home, "d") and not (home / "d").exists()
    assert not remove(home, "d") and not remove(home, "missing/file")
    assert home_trim.parts("./a//b") == ("a", "b")

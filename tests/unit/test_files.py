"""The one atomic-write rule (hermes_service/files.py, docs/data-and-durability.md); the
registry's tests kill writers mid-write and count fsyncs, these pin the helper's own contract."""
import os
import re

import pytest

from hermes_service.files import atomic_write


@pytest.mark.parametrize("prefix, pattern", [(None, r"\.state\.json\..+\.tmp"),
                                             (".mine.", r"\.mine\..+\.tmp")])
def test_a_failed_write_names_its_temp_file_as_documented_and_removes_it(tmp_path, monkeypatch,
                                                                         prefix, pattern):
    target = tmp_path / "state.json"
    target.write_text("old")
    seen = []

    def failing_replace(src, dst):
        seen.append(os.path.basename(src))
        raise OSError("disk gone")
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, "new", prefix=prefix)
    assert re.fullmatch(pattern, seen[0]) and target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_text_is_written_as_utf8_and_the_path_is_returned(tmp_path):
    target = tmp_path / "t.txt"
    assert atomic_write(target, "项目计划", durable=False) == target
    assert target.read_bytes() == "项目计划".encode()
    assert atomic_write(target, b"\xff") == target and target.read_bytes() == b"\xff"

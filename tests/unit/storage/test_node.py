"""hermes_service/storage/node.py: a turn's commit is one fenced transaction — a snapshot that
fails mid-way leaves nothing (no chunk, no manifest, the record as it was), and the node then
lets the user go so the next request restores the last acknowledged home."""
from __future__ import annotations

import pytest

from hermes_service.storage.node import SharedNode
from hermes_service.storage.snapshots import SnapshotTooSlow
from support.postgres import PASSWORD_ENV


@pytest.fixture
def node(make_config, pg_url, tmp_path):
    config = make_config({"storage": {"url": pg_url, "password_env": PASSWORD_ENV,
                                      "node_id": "n1"}})
    stopped: list[str] = []
    homes = tmp_path / "homes"
    homes.mkdir()
    shared = SharedNode(config, home_of=lambda u: homes / u, stop_user=stopped.append)
    shared.stopped = stopped
    yield shared
    shared.close()


def rows(node, sql):
    with node.engine.transaction() as conn:
        return conn.execute(sql).fetchall()


def test_a_turn_commits_the_home_and_the_record_together(node, tmp_path):
    node.sessions.create({"session_id": "s1", "user_id": "ann", "created_at": "x"})
    home = tmp_path / "homes" / "ann"
    home.mkdir()
    (home / "notes.txt").write_text("remember this")
    lease = node.ownership.lease("ann")
    rec = node.commit_turn(lease, "s1", message_count=1, hermes_session_id="h1")
    assert rec["message_count"] == 1
    assert rows(node, "SELECT seq FROM home_manifests WHERE user_id = 'ann'") == [(1,)]


def test_a_snapshot_failing_mid_way_leaves_nothing_and_lets_the_user_go(node, tmp_path,
                                                                        monkeypatch):
    node.sessions.create({"session_id": "s2", "user_id": "ben", "created_at": "x"})
    home = tmp_path / "homes" / "ben"
    home.mkdir()
    (home / "a.txt").write_text("a" * 100_000)
    lease = node.ownership.lease("ben")
    real_save = node.snapshots.save

    def save_then_fail(conn, user_id, path):
        real_save(conn, user_id, path)            # chunks and a manifest written …
        raise SnapshotTooSlow("too slow")         # … then the save fails
    monkeypatch.setattr(node.snapshots, "save", save_then_fail)
    with pytest.raises(SnapshotTooSlow):
        node.commit_turn(lease, "s2", message_count=1)
    assert rows(node, "SELECT count(*) FROM home_manifests WHERE user_id = 'ben'") == [(0,)]
    assert rows(node, "SELECT count(*) FROM home_chunks") == [(0,)]
    assert node.sessions.get("s2").get("message_count") is None
    node.abandon("ben")
    assert "ben" in node.stopped and "ben" not in node.ownership.held()


def test_check_config_and_the_start_name_why_postgresql_cannot_be_reached(make_config,
                                                                          tmp_path):
    from hermes_service import preflight
    from hermes_service.session_store import CorruptStore
    from support.postgres import _free_port
    config = make_config({"storage": {"url": f"postgresql://hermes@127.0.0.1:{_free_port()}"
                                             "/hermes", "node_id": "n1"}})
    [problem] = [p for p in preflight.problems(config) if "storage.url" in p]
    assert "cannot connect to the shared PostgreSQL" in problem
    with pytest.raises(CorruptStore, match="cannot connect to the shared PostgreSQL"):
        SharedNode(config, home_of=lambda u: tmp_path / u, stop_user=lambda u: None)

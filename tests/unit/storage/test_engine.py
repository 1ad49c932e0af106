"""hermes_service/storage/engine.py against a real temporary PostgreSQL (tests/support/postgres.py):
transactions, the password from the environment, and every way the database can fail becoming
503 ``storage_unavailable``."""
from __future__ import annotations

import psycopg
import pytest

from hermes_service.storage.engine import Engine, StorageUnavailable, password_from
from support.postgres import PASSWORD_ENV, _free_port


def engine(url: str, **kw) -> Engine:
    kw.setdefault("password", password_from(PASSWORD_ENV))
    return Engine(url, **kw).open()


def test_a_transaction_commits_and_an_exception_rolls_back(pg_url):
    eng = engine(pg_url)
    try:
        with eng.transaction() as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(RuntimeError), eng.transaction() as conn:
            conn.execute("INSERT INTO t VALUES (2)")
            raise RuntimeError("boom")
        with eng.transaction() as conn:
            assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]
    finally:
        eng.close()


def test_the_password_comes_from_the_environment_only(pg_url, monkeypatch):
    monkeypatch.setenv("SOME_PG_PASSWORD", "wrong")
    eng = engine(pg_url, password=password_from("SOME_PG_PASSWORD"), pool_wait_seconds=2)
    try:
        with pytest.raises(StorageUnavailable) as err, eng.transaction():
            pass
        assert err.value.status == 503 and err.value.code == "storage_unavailable"
        assert "wrong" not in err.value.detail
    finally:
        eng.close()
    assert password_from(None) is None and password_from("UNSET_VARIABLE_XYZ") is None


def test_an_unreachable_database_is_503_storage_unavailable_with_retry_after():
    eng = engine(f"postgresql://hermes@127.0.0.1:{_free_port()}/none", pool_wait_seconds=1)
    try:
        with pytest.raises(StorageUnavailable) as err, eng.transaction():
            pass
        assert err.value.headers["Retry-After"] == "5"
    finally:
        eng.close()


def test_a_statement_over_the_timeout_is_cancelled_and_storage_unavailable(pg_url):
    eng = engine(pg_url, statement_timeout_ms=200)
    try:
        with pytest.raises(StorageUnavailable), eng.transaction() as conn:
            conn.execute("SELECT pg_sleep(5)")
        with eng.transaction() as conn:                       # the pool is still usable
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        eng.close()


def test_a_connection_killed_by_the_server_is_replaced(pg_url, postgres):
    eng = engine(pg_url, max_size=1)
    try:
        with eng.transaction() as conn:
            pid = conn.info.backend_pid
        postgres.admin_sql(f"SELECT pg_terminate_backend({pid})")
        with eng.transaction() as conn:                       # checked out, found dead, replaced
            assert conn.info.backend_pid != pid
    finally:
        eng.close()


def test_other_database_errors_are_not_disguised(pg_url):
    eng = engine(pg_url)
    try:
        with pytest.raises(psycopg.errors.UndefinedTable), eng.transaction() as conn:
            conn.execute("SELECT * FROM no_such_table")
    finally:
        eng.close()


def test_reach_names_why_no_connection_can_be_made(pg_url):
    # the start and check-config say this where a pool would only time out
    assert Engine(pg_url, password=password_from(PASSWORD_ENV)).reach() is None
    bad_password = Engine(pg_url, password="not-the-password").reach()
    assert bad_password and "password" in bad_password and "not-the-password" not in bad_password
    closed = Engine(f"postgresql://hermes@127.0.0.1:{_free_port()}/hermes",
                    connect_timeout=2).reach()
    assert closed and ("refused" in closed.lower() or "connect" in closed.lower())

"""A real, temporary PostgreSQL cluster for the tests of the shared storage (docs/scaling.md).

* :func:`postgres_bin` / :func:`require_postgres` — Debian's server binaries
  (``/usr/lib/postgresql/<major>/bin``: ``initdb``, ``pg_ctl``, ``postgres``) or a skip that says
  why (``make setup`` installs the ``postgresql`` package when run as root);
* :class:`PostgresCluster` — ``initdb`` + ``pg_ctl start`` in a fresh directory, listening on
  127.0.0.1 on a free port (and a private socket directory), password authentication over TCP
  (the way a service node connects), trust on the socket for the harness itself. As root,
  ``initdb`` refuses to run, so the cluster runs as the unprivileged ``postgres`` user (or
  ``nobody``) through ``runuser``, in a directory that user owns. :meth:`~PostgresCluster.stop`
  and :meth:`~PostgresCluster.start` let a test take the database away and bring it back;
* fixtures: ``postgres`` — one cluster per test process (an xdist worker is one process),
  stopped at the end; ``pg_url`` — a fresh empty database of it per test, as the
  ``storage.url`` a service is configured with (the password in :data:`PASSWORD_ENV`, set in
  this process's environment, which started services inherit).

Durability settings are relaxed (``fsync=off``): the tests kill service nodes, never the
database's machine.
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

#: the role the service nodes connect as, and the variable holding its password
#: (``storage.password_env`` in the configs the tests write)
ROLE = "hermes"
PASSWORD = "pg-test-password-0123"
PASSWORD_ENV = "HERMES_TEST_PG_PASSWORD"
SUPERUSER = "postgres"


def postgres_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` holding initdb and pg_ctl, or None."""
    found = []
    for bindir in glob.glob("/usr/lib/postgresql/*/bin"):
        major = Path(bindir).parent.name
        if major.isdigit() and all(os.access(Path(bindir) / b, os.X_OK)
                                   for b in ("initdb", "pg_ctl", "postgres")):
            found.append((int(major), Path(bindir)))
    return max(found)[1] if found else None


def require_postgres() -> Path:
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed: `make setup` installs Debian's postgresql "
                    "package when run as root (apt-get install postgresql); without it the "
                    "tests of the shared storage (docs/scaling.md) cannot run")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed in this venv (make setup installs "
                    "requirements.txt)")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> str | None:
    """The unprivileged user the cluster runs as when we are root (initdb refuses root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    pytest.skip("running as root and neither a 'postgres' nor a 'nobody' user exists to run "
                "the test PostgreSQL cluster as (initdb refuses to run as root)")


class PostgresCluster:
    """One temporary cluster: ``initdb`` into ``<base>/data``, the server on ``127.0.0.1:port``
    and the socket directory ``<base>/sock``; :meth:`url` for a service, :meth:`admin` for the
    harness. ``base`` is a fresh directory under the system temp dir (pytest's own are private
    to root, and the server runs as another user)."""

    _names = itertools.count(1)

    def __init__(self):
        self.bindir = require_postgres()
        self.user = _run_as()
        self.base = Path(tempfile.mkdtemp(prefix="hermes-pg-"))
        self.data = self.base / "data"
        self.sock = self.base / "sock"
        self.sock.mkdir()
        self.log = self.base / "server.log"
        self.port = _free_port()
        pwfile = self.base / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if self.user:
            pw = pwd.getpwnam(self.user)
            for p in (self.base, self.sock, pwfile):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            os.chmod(self.base, 0o700)
        self._pg("initdb", "-D", str(self.data), "-U", SUPERUSER, "--pwfile", str(pwfile),
                 "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                 "--no-locale", "--no-sync", timeout=120)
        pwfile.unlink()
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(f"""
listen_addresses = '127.0.0.1'
port = {self.port}
unix_socket_directories = '{self.sock}'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
shared_buffers = 16MB
""")
        self.start()
        self.admin_sql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
        os.environ[PASSWORD_ENV] = PASSWORD

    def _pg(self, tool: str, *args: str, timeout: float = 60) -> str:
        cmd = [str(self.bindir / tool), *args]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             cwd=str(self.base))
        if res.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({res.returncode}): {res.stderr}\n{log}")
        return res.stdout

    def start(self, timeout: float = 60) -> PostgresCluster:
        """``pg_ctl start -w``: returns once the server accepts connections."""
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t",
                 str(int(timeout)), "start", timeout=timeout + 10)
        return self

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m <mode>`` (``fast``: open sessions are cut; ``immediate``: a crash)."""
        if (self.data / "postmaster.pid").exists():
            self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def admin(self, dbname: str = "postgres"):
        """A psycopg connection as the superuser over the socket (autocommit)."""
        import psycopg
        return psycopg.connect(host=str(self.sock), port=self.port, user=SUPERUSER,
                               dbname=dbname, autocommit=True, connect_timeout=10)

    def admin_sql(self, sql: str, dbname: str = "postgres") -> list[tuple]:
        with self.admin(dbname) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []

    def create_database(self, prefix: str = "t") -> str:
        """A fresh empty database owned by :data:`ROLE`; returns its name."""
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self.admin_sql(f"CREATE DATABASE {name} OWNER {ROLE}")
        return name

    def url(self, dbname: str) -> str:
        """The libpq URL a service node uses (``storage.url``): TCP, no password in it."""
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{dbname}"

    def cleanup(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


def wait_until_down(cluster: PostgresCluster, timeout: float = 30) -> None:
    """Wait until nothing accepts connections on the cluster's port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", cluster.port), timeout=0.5).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError("PostgreSQL still accepts connections")


@pytest.fixture(scope="session")
def postgres():
    """One temporary PostgreSQL cluster per test process; stopped and removed at the end."""
    cluster = PostgresCluster()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def pg_url(postgres) -> str:
    """A fresh empty database of :func:`postgres` as a ``storage.url`` (its password in the
    environment variable :data:`PASSWORD_ENV`)."""
    return postgres.url(postgres.create_database())

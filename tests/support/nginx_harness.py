"""Run the real nginx on loopback in front of real service processes (tests of deploy/nginx).

* :func:`nginx_binary` / :func:`require_nginx` — find Debian's nginx or skip with the reason;
* :func:`render` — a shipped config with the test's ports and paths put in place of the
  documented ADAPT values (each replaced value must be in the file: a shipped config that
  changes them fails here, not silently);
* :class:`Nginx` — ``nginx -p <tmp> -c <tmp>/nginx.conf -g 'daemon off;'``: the shipped file
  is included into a minimal main config (the part Debian's /etc/nginx/nginx.conf plays), all
  of nginx's files stay in the temp prefix;
* :func:`session_from` — a requests session whose connections leave from a chosen loopback
  address (127.0.0.5 …), so the allowlist can tell clients apart on one machine.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
from requests.adapters import HTTPAdapter

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def nginx_binary() -> str | None:
    for cand in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def require_nginx() -> str:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed: `make setup` installs it when run as root "
                    "(apt-get install nginx); without it the deploy/nginx tests cannot run")
    return binary


def render(src: Path, replacements: dict[str, str]) -> str:
    """The text of ``src`` with every key of ``replacements`` (which must occur) replaced."""
    text = src.read_text()
    for old, new in replacements.items():
        assert old in text, f"{src.name}: expected {old!r} (a documented ADAPT value)"
        text = text.replace(old, new)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """One nginx master (+1 worker) serving ``site`` (an http-context config) from ``prefix``."""

    def __init__(self, prefix: Path, site: str):
        self.binary = require_nginx()
        self.prefix = prefix
        self.logs = prefix / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        (prefix / "site.conf").write_text(site)
        user = "user root root;" if os.geteuid() == 0 else ""
        temp = "\n".join(f"  {k}_temp_path {prefix}/tmp_{k};" for k in
                         ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        self.conf = prefix / "nginx.conf"
        self.conf.write_text(f"""{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {self.logs}/main-error.log info;
events {{ worker_connections 1024; }}
http {{
  default_type application/octet-stream;
{temp}
  include {prefix}/site.conf;
}}
""")
        self.proc = None

    def check(self) -> str:
        """``nginx -t`` on the rendered config; returns its output (fails the test on errors)."""
        res = subprocess.run([self.binary, "-t", "-p", str(self.prefix), "-c", str(self.conf),
                              "-e", str(self.logs / "startup.log")],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stderr

    def start(self, port: int, timeout: float = 15) -> Nginx:
        self.check()
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [self.binary, "-p", str(self.prefix), "-c", str(self.conf), "-e",
             str(self.logs / "startup.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not start listening")

    def access_log(self) -> str:
        path = self.logs / "hermes-service.access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGQUIT)       # graceful: finish open requests
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class _SourceAddressAdapter(HTTPAdapter):
    def __init__(self, source: str):
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.source, 0)
        super().init_poolmanager(*args, **kwargs)


def session_from(source: str) -> requests.Session:
    """A requests session whose TCP connections come from ``source`` (a loopback address)."""
    s = requests.Session()
    s.mount("http://", _SourceAddressAdapter(source))
    return s

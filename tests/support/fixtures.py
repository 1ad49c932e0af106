"""Shared fixtures.

* ``model`` — the scripted OpenAI-compatible model server (hermes_service/scripted_model/),
  one per test process, on 127.0.0.1.
* ``service`` / ``start_service`` — the REAL service: ``python3 main.py`` (waitress)
  in a subprocess on a free port, with its own config file and data dir, running the
  real ``hermes`` CLI against ``model``.
* ``make_config`` / ``app_factory`` — in-process config and Flask app for unit tests.
"""
from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from hermes_service.scripted_model import ScriptedModel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

API_KEY = "test-key-0123456789abcdef"
PROVIDER_KEY_ENV = "SCRIPTED_PROVIDER_KEY"
# in-process apps (make_config/app_factory) see a configured provider key, like the services
# started below; tests of an unset key remove it (monkeypatch.delenv, env={...: None})
os.environ.setdefault(PROVIDER_KEY_ENV, "sk-scripted")


def hermes_bin() -> str:
    """The real hermes CLI: $HERMES_BIN, .hermes-venv/bin/hermes, or PATH."""
    for cand in (os.environ.get("HERMES_BIN"), str(ROOT / ".hermes-venv" / "bin" / "hermes"),
                 shutil.which("hermes")):
        if cand and os.access(cand, os.X_OK):
            return cand
    pytest.fail("the hermes CLI is not installed (make setup installs it into .hermes-venv)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_config(tmp: Path, model_url: str = "http://127.0.0.1:9/v1") -> dict:
    return {
        "security": {"enable_ip_check": True, "allowed_ips": ["127.0.0.1", "::1"],
                     "enable_api_key": True, "auth_method": "header",
                     "api_keys": [{"key": API_KEY, "description": "tests",
                                   "scopes": ["v1", "client", "execute", "metrics"]}]},
        # drain_seconds 0: a test ending with a turn in flight stops its service at once (as
        # before the drain existed); test_e2e_shutdown.py sets it to test the drain
        "service": {"host": "127.0.0.1", "port": 0, "log_level": "info", "threads": 24,
                    "drain_seconds": 0},
        "hermes": {"command": hermes_bin(), "timeout_seconds": 120, "stall_timeout_seconds": 120,
                   "max_concurrent_runs": 2, "queue_wait_seconds": 60,
                   "extra_env": {"HERMES_STREAM_RETRIES": "0"},
                   # the watcher only: as root, quota auto would loop-mount an image per home
                   # in every test's data dir (tests/e2e/test_e2e_disk_image.py asks for them)
                   "sandbox": {"quota": "watch"},
                   "model": {"provider": "custom", "base_url": model_url,
                             "default": "scripted-model", "api_key_env": PROVIDER_KEY_ENV}},
        "paths": {"data_dir": str(tmp / "data"), "users_template": str(ROOT / "users_template")},
        # the client routes on the CLI runner unless a test chooses (the shipped default is
        # acp: test_quickstart/test_e2e_demo); unit tests stub the CLI runner's seam
        "mnote": {"runner": "cli"},
    }


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="session")
def model():
    server = ScriptedModel("scripted-model").start()
    yield server
    server.stop()


class ServiceProcess:
    """``python3 main.py --config <file> --port <free>`` as a subprocess."""

    def __init__(self, tmp: Path, cfg: dict, env_extra: dict | None = None,
                 wrap: list[str] | None = None):
        self.tmp = tmp
        self.wrap = list(wrap or [])     # a command the service runs under (e.g. unshare)
        self.cfg = cfg
        self.config_path = tmp / f"config-{time.monotonic_ns()}.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.data_dir = Path(cfg["paths"]["data_dir"])
        env = {**os.environ, PROVIDER_KEY_ENV: "sk-scripted", **(env_extra or {})}
        self.env = {k: v for k, v in env.items() if v is not None}   # None: unset it
        self.proc = None
        self.log_path = tmp / f"service-{time.monotonic_ns()}.log"

    def start(self, timeout: float = 20.0, port: int | None = None) -> ServiceProcess:
        """Start on ``port`` (a free one when None; a restart passes its old port)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.wrap, sys.executable, str(ROOT / "main.py"), "--config",
             str(self.config_path), "--port", str(self.port)], cwd=str(ROOT), env=self.env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited rc={self.proc.returncode}:\n{self.log()}")
            try:
                requests.get(self.url + "/health", timeout=1)
                return self
            except requests.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"service did not start:\n{self.log()}")

    def log(self) -> str:
        """The service's log as written so far. Its lines reach the file from a writer thread
        just after they are logged (docs/operations.md §Logs): a test reading the log after a
        request waits with :meth:`wait_log` or :meth:`log_through` instead of reading once."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, *texts: str, timeout: float = 30.0) -> str:
        """The log once every one of ``texts`` is in it (polls; AssertionError after
        ``timeout`` s, with the log)."""
        def holds():
            log = self.log()
            return log if all(t in log for t in texts) else ""
        return wait_for(holds, f"{texts} in the service log", timeout, log=self.log)

    def log_through(self, res: requests.Response, timeout: float = 30.0) -> str:
        """The log once it holds the access line of response ``res`` (its ``X-Request-Id``):
        every line logged before that response's access line is then in it too, so a test
        can also check what the log does *not* say."""
        rid = res.headers["X-Request-Id"]

        def through():
            log = self.log()
            return log if any("hermes_service.access" in line and rid in line
                              for line in log.splitlines()) else ""
        return wait_for(through, f"the access line of {rid} in the service log", timeout,
                        log=self.log)

    def stop(self, sig=signal.SIGTERM, wait: float = 10.0) -> None:
        """Signal the service's process group; SIGKILL after ``wait`` seconds (a drain)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    # HTTP helpers (API key sent unless headers override it)
    def request(self, method: str, path: str, key: str | None = API_KEY, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if key is not None:
            headers.setdefault("X-API-Key", key)
        kw.setdefault("timeout", 180)
        return requests.request(method, self.url + path, headers=headers, **kw)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, **kw):
        return self.request("POST", path, **kw)

    def delete(self, path, **kw):
        return self.request("DELETE", path, **kw)


@pytest.fixture
def start_service(tmp_path, model):
    """Factory: ``start_service(overrides: dict = {}, env=None, tmp=None, wrap=None)`` → a
    started ServiceProcess (``wrap``: a command prefix the service runs under)."""
    started = []

    def start(overrides: dict | None = None, env: dict | None = None, tmp: Path | None = None,
              wrap: list[str] | None = None):
        cfg = deep_merge(base_config(tmp or tmp_path, model.base_url), overrides or {})
        svc = ServiceProcess(tmp or tmp_path, cfg, env, wrap).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def service(start_service):
    return start_service()


@pytest.fixture
def make_config(tmp_path):
    """Factory: in-process :class:`Config` from ``base_config`` + overrides."""
    from hermes_service.installed import build_config

    def make(overrides: dict | None = None):
        return build_config(deep_merge(base_config(tmp_path), overrides or {}))
    return make


@pytest.fixture
def app_factory(make_config):
    """Factory: a Flask app (in-process; unit tests may swap the runner at its seam)."""
    from hermes_service import create_app

    def make(overrides: dict | None = None):
        app = create_app(make_config(overrides))
        app.testing = True
        return app
    return make


class StubTurns:
    """Scripted replacement for ``CliRunner.run_process`` (one CLI process) in unit tests.

    Records each call (``message``, ``resume_id``, ``env``, ``cwd`` (the UserHome), ``args``,
    and ``run_file``: the mnote run binding the plugin would read). Answers with the
    next of ``outcomes``, else ``answer``, else ``echo #N: <message>`` (N = turns in that home).
    Like Hermes, a successful turn is written to the home's ``state.db``
    (tests/support/hermes_record.py) — the service reads the answer from there — while its stdout
    carries a decoy (``STDOUT_DECOY``): an answer taken from stdout shows. ``record`` may
    replace what is recorded: ``{"answer": …, "reasoning": …}`` for the next turns.
    ``block()`` runs first when set; while ``gate`` (an Event) is set-able, the turn waits for it
    and honours the run's cancel event like a killed process would.
    """
    STDOUT_DECOY = "\n╭─ ⚕ Hermes ─╮ (the terminal's copy, never the answer)\n"
    SID_LINE = "\nsession_id: 20260101_000000_abcdef\n"

    def __init__(self):
        self.calls, self.outcomes = [], []
        self.answer = self.block = self.gate = self.record = None

    def touch(self):
        pass

    def kill(self, reason):
        pass

    def __call__(self, args, env, cwd, on_spawn, cancel, log_ctx):
        from hermes_service.runner import Outcome
        message = next(a for a in args if a.startswith("--query="))[len("--query="):]
        resume_id = args[args.index("--resume") + 1] if "--resume" in args else None
        from hermes_service.hermes_site import run_binding
        binding = None                    # the plugin's run binding, in the CLI's environment
        if env.get(run_binding.ENV):
            binding = run_binding.decode(env[run_binding.ENV])
        self.calls.append({"message": message, "resume_id": resume_id, "env": env, "cwd": cwd,
                           "args": args, "run_binding": binding})
        if on_spawn:
            on_spawn(self)             # stands in for the CliProcess (touch/kill)
        if self.block:
            self.block()
        if self.gate is not None:
            while not self.gate.wait(0.05):
                if cancel is not None and cancel.is_set():
                    return Outcome(130, "", self.SID_LINE, 0.1, killed="cancelled")
        if self.outcomes:
            return self.outcomes.pop(0)
        n = sum(1 for c in self.calls if c["cwd"] == cwd)
        answer = self.answer or f"echo #{n}: {message}"
        if hasattr(cwd, "hermes_home"):           # the user's home: record the turn there
            from support.hermes_record import record_turn
            rec = {"answer": answer, **(self.record or {})}
            record_turn(cwd.hermes_home, self.SID_LINE.split(":")[1].strip(), message, **rec)
            answer += self.STDOUT_DECOY
        return Outcome(0, answer + "\n", self.SID_LINE, 0.01)


@pytest.fixture
def stub():
    return StubTurns()


@pytest.fixture
def stubbed_app(app_factory, stub, monkeypatch):
    """Factory: an in-process app whose CLI runner runs ``stub`` for each process
    (its public seam, ``CliRunner.run_process``)."""
    def make(overrides: dict | None = None):
        app = app_factory(overrides)
        monkeypatch.setattr(app.extensions["hermes_service"].runner, "run_process", stub)
        return app
    return make


def wait_for(condition, what: str = "condition", timeout: float = 60.0, log=None):
    """Poll ``condition()`` until it is true and return its value; fail naming ``what`` after
    ``timeout`` seconds (with ``log()``, e.g. the service's log, when given). Tests wait for
    conditions, never for fixed times."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}" + (f":\n{log()}" if log else ""))
        time.sleep(0.02)
    return value


def hermes_processes(marker: str) -> list[int]:
    """PIDs of live processes whose command line or environment mentions ``marker`` — or,
    for a process in a sandbox (which sees neither host paths nor the service's environment),
    whose mount table does (a user's home path: the source of its ``/home/hermes``)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes()
            mounts = (d / "mountinfo").read_bytes() if b"/home/hermes" in env else b""
        except OSError:
            continue
        if marker.encode() in cmd or marker.encode() in env or _mounted_at_home(mounts, marker):
            found.append(int(d.name))
    return found


def _mounted_at_home(mountinfo: bytes, path: str) -> bool:
    """Does a sandbox's mount table bind ``path`` at ``/home/hermes``? (The mount's root
    field is the path inside its file system: a suffix of ``path``.)"""
    for line in mountinfo.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/home/hermes" and len(fields[3]) > 1 \
                and path.endswith(fields[3]):
            return True
    return False


@pytest.fixture
def other():
    """A live process standing in for another service process on the data dir: ``.owner``
    its owner id (:func:`hermes_service.instance.current` form), ``.die()`` makes it dead."""
    from hermes_service import instance
    proc = subprocess.Popen(["sleep", "300"])
    proc.owner = f"{proc.pid}-{instance.proc_start(proc.pid)}"

    def die():
        proc.kill()
        proc.wait()
    proc.die = die
    yield proc
    if proc.poll() is None:
        die()


def race(app, count, send_one):
    """Run ``send_one(client)`` in ``count`` threads released at once (a barrier), each with
    its own test client of ``app``. Returns ``(threads, responses)``; join the threads."""
    out, start = [None] * count, threading.Barrier(count)

    def one(i):
        client = app.test_client()
        start.wait()
        out[i] = send_one(client)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, out

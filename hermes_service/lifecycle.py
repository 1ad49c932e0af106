"""Process lifetime of the serving process (docs/operations.md §Process lifetime,
docs/configuring.md §Reload, §Limits).

* :func:`waitress_options` — connection limit, idle timeout and body size enforced by waitress
  itself, before Flask (and before any IP or key check) sees a request;
* :class:`ServiceRecord` — ``data/service-pids/<pid>.json`` while a service serves: how
  ``main.py reload`` finds it (pid + start time, so a reused pid is never signalled) and
  where the service reports each reload's outcome;
* :func:`reload_config` — SIGHUP: re-read the config file, refuse it with its problems or
  hand it to the running service objects (:meth:`~hermes_service.services.Services.apply`);
* :class:`Lifecycle` — SIGTERM and SIGINT stop the service the same way, in two steps:
  the **drain** (up to ``service.drain_seconds``; skipped when 0): no new turn is accepted
  (503 ``service_draining``, ``/health`` 503 ``draining``), the turns in progress may finish
  and their event streams deliver their terminal events; then the **stop**, for what is left:
  no new Hermes process, every process group killed at once, runs end with their terminal
  event (``service_stopping``), which open event streams deliver before the process exits
  (bounded by :data:`DRAIN_SECONDS`); CLI pid records and the service record are removed. A
  second signal during the drain starts the stop at once; one during the stop leaves the
  serving loop at once. docs/operations.md §Process lifetime.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import logs, metrics, preflight
from .config import Config, ConfigError, keep_running, load_config, restart_only
from .files import atomic_write
from .installed import route_families
from .instance import proc_start

log = logging.getLogger("hermes_service")

#: How long a stop waits, after killing the CLI groups, for runs to end and open responses
#: (event streams, v1 answers) to be written out.
DRAIN_SECONDS = 1.5
RECORD_DIR = "service-pids"


def provider_host(url: str | None) -> str:
    """The provider's host (and port) for the log: never a path, query or credentials."""
    from urllib.parse import urlsplit
    if not url:
        return "(no provider)"
    parts = urlsplit(url)
    return parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else "?"


def running(config: Config, sandbox) -> str:
    """What the service runs, for the start and reload lines (docs/operations.md §Logs): ``runner R
    (panel P), model M at HOST[:PORT], sandbox S, data dir D`` — R the v1 API's runner, then
    each extension family's label and runner (e.g. ``panel``: the client routes'); the
    provider by host only, never its key or URL path."""
    model = config.hermes.model
    families = route_families(config)
    labelled = "".join(f" ({f.label} {f.runner})" for f in families if f.label)
    return (f"runner {families[0].runner}{labelled}, "
            f"model {model.default or '-'} at "
            f"{provider_host(model.base_url)}, sandbox {sandbox.describe()}, "
            f"data dir {config.data_dir}")


def no_provider(config: Config) -> str | None:
    """The one line saying no model turn can work and what to set (start and reload;
    docs/operations.md §Logs), or None when the provider is usable
    (:attr:`Config.provider_issues`)."""
    if not config.provider_issues:
        return None
    return (f"no model provider: {'; '.join(config.provider_issues)} — until it is set every "
            "turn is answered 503 hermes_unconfigured (README, first screen; config.yaml: then "
            "`.venv/bin/python main.py reload`; an environment variable: restart the service "
            "with it exported); to try the service without a provider: `make demo`")


def waitress_options(config: Config, threads: int | None = None) -> dict:
    """waitress settings from ``service.*`` (docs/configuring.md §Limits):

    * ``connection_limit`` — open connections (waitress stops accepting beyond it);
    * ``channel_timeout`` = ``idle_timeout_seconds`` and ``cleanup_interval`` = a quarter of
      it: a connection with no request in progress (idle keep-alive, or headers/body never
      completed) is closed 1–1.25 × ``idle_timeout_seconds`` after its last byte; requests
      being answered (long turns, event streams) are never cut;
    * ``max_request_body_size`` = ``max_body_bytes`` + 1: a larger declared Content-Length
      is refused (413) right after the headers, a chunked body is cut at the limit;
    * ``channel_request_lookahead`` = 1: waitress keeps reading a connection while its request
      is answered, so it sees at once when a client closes an event stream (and can read one
      pipelined request ahead); an event stream's watcher (e.g. the client proxy's) then ends
      the stream through ``waitress.client_disconnected``, freeing its slot and thread within
      ~1 s instead of after a failed keepalive write (docs/mnote-client.md §Event-stream fan-out).
    """
    svc = config.service
    idle = svc.idle_timeout_seconds
    return {
        "threads": threads or svc.threads,
        "connection_limit": svc.connection_limit,
        "channel_timeout": idle,
        "cleanup_interval": max(1, idle // 4),
        "max_request_body_size": svc.max_body_bytes + 1,   # waitress refuses >= this
        "channel_request_lookahead": 1,   # see a client close while its stream is answered
        "asyncore_use_poll": True,     # select() breaks on descriptors above 1024
        "ident": "hermes-service",
        # X-Forwarded-For is judged by security.Guard (nginx.trusted_proxies); waitress
        # must pass it through instead of dropping it
        "clear_untrusted_proxy_headers": False,
    }


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data), durable=False)


def drain_line(signum: int, seconds: float, turns: list[str]) -> str:
    """The log line that starts a drain (docs/operations.md §Process lifetime): the turns in
    progress it waits for, or — with none — that the stop goes on at once."""
    if not turns:
        return f"signal {signum}: draining: no new turns; no turn in progress: stopping now"
    return (f"signal {signum}: draining: no new turns; waiting up to {seconds:g} s "
            "(service.drain_seconds; a second signal stops at once) for "
            f"{len(turns)} turn(s) in progress: {', '.join(turns)}")


class ServiceRecord:
    """``<data_dir>/service-pids/<pid>.json`` of this serving process:
    ``{"pid", "start", "config", "url", "reload": {"seq", "ok", "lines", "at"}}``."""

    def __init__(self, data_dir: Path, config_path: str, url: str):
        self.path = Path(data_dir) / RECORD_DIR / f"{os.getpid()}.json"
        self.data: dict[str, Any] = {"pid": os.getpid(), "start": proc_start(os.getpid()),
                     "config": str(Path(config_path).resolve()), "url": url,
                     "reload": {"seq": 0, "ok": None, "lines": [], "at": None}}
        self._lock = threading.Lock()

    def write(self) -> None:
        with self._lock:
            _write_json(self.path, self.data)

    def reloaded(self, ok: bool, lines: list[str]) -> None:
        with self._lock:
            r = self.data["reload"]
            self.data["reload"] = {"seq": r["seq"] + 1, "ok": ok, "lines": lines,
                                   "at": datetime.now(UTC).isoformat()}
            _write_json(self.path, self.data)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def live_services(data_dir: Path) -> list[dict]:
    """Records of serving processes on ``data_dir`` that still run (same pid, same start);
    records of dead processes are removed."""
    out = []
    for path in sorted((Path(data_dir) / RECORD_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            alive = data.get("start") is not None and proc_start(data["pid"]) == data["start"]
        except (OSError, ValueError, KeyError, TypeError):
            alive = False
        if alive:
            out.append(data)
        else:
            path.unlink(missing_ok=True)
    return out


def request_reload(data_dir: Path, timeout: float = 15.0,
                   config_path: str | None = None) -> list[tuple[int, dict | None]]:
    """SIGHUP every live service on ``data_dir`` (``config_path``: only those serving that
    file); wait for each to report the outcome.

    Returns ``[(pid, reload_status or None if it did not answer within timeout)]`` (empty
    when none runs)."""
    targets = live_services(data_dir)
    if config_path is not None:
        wanted = str(Path(config_path).resolve())
        targets = [rec for rec in targets if rec.get("config") == wanted]
    for rec in targets:
        os.kill(rec["pid"], signal.SIGHUP)
    results, deadline = [], time.monotonic() + timeout
    for rec in targets:
        path = Path(data_dir) / RECORD_DIR / f"{rec['pid']}.json"
        status = None
        while time.monotonic() < deadline:
            try:
                now = json.loads(path.read_text())["reload"]
            except (OSError, ValueError, KeyError):
                now = None
            if now and now["seq"] > rec["reload"]["seq"]:
                status = now
                break
            time.sleep(0.05)
        results.append((rec["pid"], status))
    return results


def reload_config(svc, path: str) -> tuple[bool, list[str]]:
    """Re-read ``path`` and apply it to the running service objects (docs/configuring.md §Reload).

    Returns ``(True, notes)`` when applied — notes name changed settings that need a
    restart (their running values stay) and the new config's warnings — or
    ``(False, problems)`` when refused: the file has a problem ``check-config`` would
    report, or the world it names does (command, template, data dir); the running config
    stays. Never raises for a bad file. A refused file's problems are all of them at once: the
    file's own, and what its valid keys name (as :func:`preflight.load_and_check` finds them).
    """
    try:     # with the overlay (``--demo``) and extension sections the service started with
        new = load_config(path, overlay=getattr(svc.config, "overlay", None),
                          sections=svc.config.extension_sections)
    except ConfigError as exc:
        named = preflight.problems(exc.partial, store=False, invalid=exc.invalid) \
            if exc.partial is not None else []
        return False, exc.problems + named
    running: Config = svc.config
    changed = restart_only(running, new)
    if changed or running.overrides:    # the running values stay (and a --threads override)
        try:   # the new limits must fit the running threads and connections
            new = keep_running(running, new)
        except ConfigError as exc:
            return False, exc.problems
    problems = preflight.problems(new, store=False)
    if problems:
        return False, problems
    svc.apply(new)
    notes = [f"{new.source}:{key}: changed, but needs a restart; the running value stays"
             for key in changed]
    return True, notes + [f"warning: {w}" for w in new.warnings]


class Lifecycle:
    """Signals of one serving process: SIGHUP reloads, SIGTERM/SIGINT stop (see module doc).

    ``channels()`` lists the server's open HTTP channels (for the drain)."""

    def __init__(self, svc, config_path: str, record: ServiceRecord, channels):
        self.svc = svc
        self.config_path = config_path
        self.record = record
        self.channels = channels
        self._reload_lock = threading.Lock()
        self._stopping = False            # a signal came: draining or stopping
        self._killing = False             # past the drain: killing what is left
        self._hurry = threading.Event()   # a second signal during the drain
        self._stopped = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    # -- reload ----------------------------------------------------------
    def _on_hup(self, _signum, _frame) -> None:
        threading.Thread(target=self.reload, name="reload", daemon=True).start()

    def reload(self) -> bool:
        """Reload now (one at a time); logs and records the outcome. Returns whether applied."""
        with self._reload_lock:
            ok, lines = reload_config(self.svc, self.config_path)
            # one line in the start line's words (docs/operations.md §Logs), then the notes
            if ok:
                config = self.svc.config
                log.info("reloaded %s; serving on %s (pid %d): %s", self.config_path,
                         self.record.data["url"], os.getpid(), running(config, self.svc.sandbox))
                issues = {f"warning: {i}" for i in config.provider_issues}
                for line in lines:
                    if line not in issues:
                        log.warning("reload: %s", line)
                if issues:
                    log.warning("%s", no_provider(config))
            else:
                log.error("reload refused; the running config stays. Problems:")
                for line in lines:
                    log.error("reload refused: %s", line)
            self.record.reloaded(ok, lines)
            return ok

    # -- stop ------------------------------------------------------------
    def _on_stop(self, signum, _frame) -> None:
        if self._stopped.is_set() or self._killing:
            # the stop is over (or another Ctrl-C during it): leave the serving loop now
            raise SystemExit(0)
        if self._stopping:          # a second signal during the drain: stop at once
            self._hurry.set()
            return
        self._stopping = True
        threading.Thread(target=self._stop, args=(signum,), name="shutdown", daemon=True).start()

    def _busy(self) -> bool:
        """Does any connection still have a request in progress or output not yet sent?"""
        return any(ch.requests or ch.total_outbufs_len for ch in self.channels())

    def _drain(self, signum: int, seconds: float) -> None:
        """Let the turns in progress finish, for up to ``seconds`` or until a second signal
        (:meth:`Services.drain`); logs its start, each turn that ends and its end
        (docs/operations.md §Logs)."""
        svc = self.svc
        started = time.monotonic()
        svc.drain()
        left = svc.in_flight()
        log.info("%s", drain_line(signum, seconds, list(left.values())))
        deadline = started + seconds
        while left and not self._hurry.is_set() and time.monotonic() < deadline:
            self._hurry.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            now = svc.in_flight()
            for key in [k for k in left if k not in now]:
                log.info("draining: %s ended (%s); %s", left[key], svc.outcome(key),
                         f"{len(now)} turn(s) left" if now else "no turn left")
            left = now
        took = time.monotonic() - started
        if not left:
            log.info("drain ended: every turn finished in %.1f s", took)
        else:
            why = "a second signal" if self._hurry.is_set() else \
                f"service.drain_seconds ({seconds:g} s)"
            log.warning("drain ended after %.1f s by %s: stopping %d turn(s) still in "
                        "progress: %s", took, why, len(left), ", ".join(left.values()))
        metrics.set_draining(False)

    def _stop(self, signum: int) -> None:
        drain = float(self.svc.config.service.drain_seconds)
        if drain > 0:
            self._drain(signum, drain)
        self._killing = True
        started = time.monotonic()
        processes = self.svc.processes
        killed = self.svc.shutdown()      # no new Hermes process; queued runs end now
        deadline = time.monotonic() + DRAIN_SECONDS
        while self._busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        left = drop_own_pid_records(processes.groups.pid_dir)
        self.record.remove()
        log.info("signal %d: killed %d Hermes process group(s); stopped in %.0f ms%s",
                 signum, killed, (time.monotonic() - started) * 1000,
                 " (some responses were still open)" if self._busy() else "")
        if left:
            log.warning("Hermes process groups still alive at exit: %s", left)
        logs.flush()                      # the stop's lines reach the log before the exit
        self._stopped.set()
        os.kill(os.getpid(), signum)      # back to the main thread: leave the serving loop


def drop_own_pid_records(pid_dir: Path | None) -> list[int]:
    """Remove this process's CLI pid records whose process group is gone; returns the
    groups still alive (their records stay for the next start's reaping)."""
    alive: list[int] = []
    if pid_dir is None:
        return alive
    for path in Path(pid_dir).glob("*.json"):
        try:
            info = json.loads(path.read_text())
            pgid = int(path.stem)
        except (OSError, ValueError):
            continue
        if info.get("service_pid") != os.getpid():
            continue
        try:
            os.killpg(pgid, 0)
            alive.append(pgid)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            alive.append(pgid)
    return alive

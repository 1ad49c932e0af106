"""The sizes a config leaves to the machine (docs/scaling.md §Sizing a node): a limit the file
leaves ``null`` (the shipped default) is derived from the machine the service starts on
(:mod:`hermes_service.machine`), by what each turn costs; a limit the operator set stays as
set. ``check-config`` prints the rule with the numbers it computed (:func:`explain`).

* ``hermes.max_concurrent_runs`` (CLI turns, and the start of a warm process, at once): the
  cores — a CLI turn is ~5 s of CPU, nearly all of it Hermes starting, so more only share
  the cores;
* ``hermes.acp.max_processes`` (warm ``hermes acp`` processes): what the memory holds, at
  :data:`WARM_PROCESS_MB` each, after the service, the CLI turns and the free-memory floor —
  a warm turn waits on the provider, its CPU is small;
* ``hermes.acp.min_available_mb`` (the floor under which idle warm processes are closed and
  no new one starts): a sixteenth of the memory, within [256, 2048] MiB;
* an extension's own (mnote: its event streams, from its active runs:
  :attr:`~.model.ConfigSection.size`);
* ``service.threads``: what the limits hold (:attr:`~.model.Config.threads_needed`), and
  ``service.connection_limit``: at least 500, and the threads plus spare connections.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import machine as machine_probe
from ..machine import Machine
from .model import SPARE_CONNECTIONS, with_sections

#: Memory one warm ``hermes acp`` process holds, its sandbox included (MiB; measured:
#: docs/scaling.md §Sizing a node)
WARM_PROCESS_MB = 150
#: Memory one running CLI turn holds (MiB; its process group, measured ~115-200)
CLI_TURN_MB = 200
#: The service's own memory, its threads and runs included (MiB; measured ~50-120)
SERVICE_MB = 256
#: The most warm processes a derived pool holds, whatever the memory (each is a process, a
#: few pipes and a connection of the loop)
MAX_AUTO_PROCESSES = 256
#: The bounds of the derived free-memory floor (MiB)
FLOOR_MB = (256, 2048)
#: ``service.connection_limit``'s least derived value
MIN_CONNECTIONS = 500


@dataclass(frozen=True)
class Sizing:
    """The machine a config was sized for and the dotted keys it derived (the file left them
    null)."""
    machine: Machine
    auto: tuple[str, ...] = ()


def memory_floor_mb(m: Machine) -> int:
    """The derived ``hermes.acp.min_available_mb``."""
    return max(FLOOR_MB[0], min(FLOOR_MB[1], m.memory_mb // 16))


def warm_processes(m: Machine, cli_slots: int, floor_mb: int) -> int:
    """The derived ``hermes.acp.max_processes``: (memory − service − CLI turns − floor) /
    :data:`WARM_PROCESS_MB`, at least 1, at most :data:`MAX_AUTO_PROCESSES`."""
    left = m.memory_mb - SERVICE_MB - cli_slots * CLI_TURN_MB - floor_mb
    return max(1, min(MAX_AUTO_PROCESSES, left // WARM_PROCESS_MB))


def size_hermes(raw: dict, m: Machine) -> tuple[dict, list[str]]:
    """The ``hermes`` mapping (merged over the defaults) with its null limits derived for
    ``m``, and the dotted keys derived."""
    raw = {**raw, "acp": dict(raw["acp"])}
    auto = []
    if raw.get("max_concurrent_runs") is None:
        raw["max_concurrent_runs"] = m.cores
        auto.append("hermes.max_concurrent_runs")
    acp = raw["acp"]
    if acp.get("min_available_mb") is None:
        acp["min_available_mb"] = memory_floor_mb(m)
        auto.append("hermes.acp.min_available_mb")
    if acp.get("max_processes") is None:
        acp["max_processes"] = warm_processes(m, raw["max_concurrent_runs"],
                                              acp["min_available_mb"])
        auto.append("hermes.acp.max_processes")
    return raw, auto


def size_rest(config, service_raw: dict):
    """``config`` (its ``hermes`` section sized) with the extensions' null limits derived
    (:attr:`~.model.ConfigSection.size`), then ``service.threads`` and
    ``service.connection_limit`` when ``service_raw`` (the file's ``service`` mapping over
    the defaults) leaves them null. Its :attr:`~.model.Config.sizing` lists every key
    derived."""
    auto = list(config.sizing.auto) if config.sizing else []
    sections = {}
    for s in config.extension_sections:
        if s.size is not None:
            settings, derived = s.size(config, config.extensions[s.name])
            sections[s.name] = settings
            auto += derived
    if sections:
        config = with_sections(config, sections)
    svc = config.service
    changes = {}
    if service_raw.get("threads") is None:
        changes["threads"] = config.threads_needed
        auto.append("service.threads")
    threads = changes.get("threads", svc.threads)
    if service_raw.get("connection_limit") is None:
        changes["connection_limit"] = max(MIN_CONNECTIONS, threads + SPARE_CONNECTIONS)
        auto.append("service.connection_limit")
    return with_sections(config, {"service": replace(svc, **changes)},
                         sizing=Sizing(config.sizing.machine if config.sizing
                                       else machine_probe.probe(), tuple(auto)))


def summary(config) -> str:
    """One line of the node's limits (the service's start log; docs/operations.md §Logs)."""
    h, svc = config.hermes, config.service
    m = config.sizing.machine if config.sizing else None
    machine = f" for {m.cores} cores, {m.memory_mb} MiB" if m else ""
    return (f"{h.max_concurrent_runs} turn slots, {h.acp.max_processes} warm processes at "
            f"most, {svc.threads} threads{machine} (check-config explains each)")


def explain(config) -> list[str]:
    """The sizing rule with its numbers, one line each (``check-config``; docs/scaling.md
    §Sizing a node): the machine, then each derived limit and how it was computed."""
    if config.sizing is None:
        return []
    m, auto = config.sizing.machine, set(config.sizing.auto)
    h, svc = config.hermes, config.service

    def tag(key: str) -> str:
        return "derived" if key in auto else "set in the file"
    lines = [f"machine: {m.cores} cores, {m.memory_mb} MiB ({m.memory_source})",
             f"hermes.max_concurrent_runs: {h.max_concurrent_runs} "
             f"({tag('hermes.max_concurrent_runs')}; rule: the cores) — CLI turns and "
             "warm-process starts at once, ~5 s CPU each",
             f"hermes.acp.min_available_mb: {h.acp.min_available_mb} "
             f"({tag('hermes.acp.min_available_mb')}; rule: memory / 16 within "
             f"{FLOOR_MB[0]}-{FLOOR_MB[1]})",
             f"hermes.acp.max_processes: {h.acp.max_processes} "
             f"({tag('hermes.acp.max_processes')}; rule: ({m.memory_mb} − {SERVICE_MB} service − "
             f"{h.max_concurrent_runs} × {CLI_TURN_MB} CLI − {h.acp.min_available_mb} floor) / "
             f"{WARM_PROCESS_MB} per warm user, ≤ {MAX_AUTO_PROCESSES}) — panel users "
             f"answered at once on warm processes, ~"
             f"{h.acp.max_processes * WARM_PROCESS_MB // 1024 or 1} GiB at "
             f"{WARM_PROCESS_MB} MiB each"]
    for s in config.extension_sections:
        if s.explain is not None:
            lines += s.explain(config, auto)
    lines += [f"service.threads: {svc.threads} ({tag('service.threads')}; rule: "
              f"{config.threads_needed} = what the limits hold)",
              f"service.connection_limit: {svc.connection_limit} "
              f"({tag('service.connection_limit')}; rule: ≥ {MIN_CONNECTIONS} and threads + 100)"]
    return lines

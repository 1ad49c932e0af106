"""``hermes.sandbox``: the settings of the launcher (docs/sandbox.md; each key's meaning in
config.yaml), the modes and networks it knows, and the toolsets that reach the host."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..egress_policy import Policy

#: The environment variables a Hermes home's config.yaml names for the model: the
#: pass-through endpoint's URL and this process's credential there (user_homes.py).
MODEL_URL_ENV = "HERMES_SERVICE_MODEL_URL"
MODEL_KEY_ENV = "HERMES_SERVICE_MODEL_KEY"

MODES = ("auto", "bwrap", "none")
#: ``hermes.sandbox.network``: ``isolated`` — a network namespace of its own per sandbox,
#: the service reached over Unix sockets (:mod:`hermes_service.sandbox_net`); ``host`` — the
#: host's network, as an unconfined process has.
NETWORKS = ("isolated", "host")
#: Toolsets whose tools reach the host (processes, files, browsers, other agents, cron):
#: unconfined they see every user's home and the service's files (Hermes 0.19.0
#: toolsets/; docs/hermes-cli-notes.md).
HOST_TOOLSETS = frozenset({
    "terminal", "file", "code_execution", "browser", "computer_use", "delegation", "cronjob",
    "coding", "debugging", "project", "vision", "video", "image_gen", "tts", "homeassistant",
    "all", "*"})
#: ... and every platform bundle (``hermes-cli``, ``hermes-acp``, ``hermes-telegram``, …),
#: which include the terminal and file tools.
HOST_TOOLSET_PREFIX = "hermes-"


@dataclass(frozen=True)
class Limits:
    """``hermes.sandbox.limits``: ``memory_mb`` (MiB, the whole sandbox with a cgroup, else
    address space per process ×2), ``processes`` (processes and threads), ``cpu_seconds``
    (per process; a warm ACP process is recycled at half of it), ``file_size_mb`` (largest
    file a process may write), ``open_files`` (per process), ``tmp_mb`` (``/tmp``)."""
    memory_mb: int = 2048
    processes: int = 256
    cpu_seconds: int = 600
    file_size_mb: int = 512
    open_files: int = 1024
    tmp_mb: int = 256


@dataclass(frozen=True)
class Egress:
    """``hermes.sandbox.egress``: ``allow``/``deny`` destinations of the egress proxy
    (:mod:`hermes_service.egress_policy`; empty ``allow``: no internet) and
    ``max_connections`` one sandbox may hold open through it."""
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    max_connections: int = 64

    def policy(self) -> Policy:
        """Raises ValueError for an entry the policy cannot read (config checks it first)."""
        return Policy.from_lists(self.allow, self.deny)


@dataclass(frozen=True)
class Settings:
    """``hermes.sandbox``: see config.yaml for each key."""
    mode: str = "auto"
    allow_host_tools: bool = False
    max_home_mb: float = 2048
    bwrap: str = "bwrap"
    limits: Limits = field(default_factory=Limits)
    quota: str = "auto"              # how max_home_mb holds during a turn (disk.py)
    min_free_mb: float = 512         # the free-space floor of the data and homes file systems
    network: str = "isolated"
    allow_host_network: bool = False
    egress: Egress = field(default_factory=Egress)

    @classmethod
    def from_config(cls, section: dict) -> Settings:
        eg = section["egress"]
        return cls(mode=section["mode"], allow_host_tools=section["allow_host_tools"],
                   max_home_mb=section["max_home_mb"], bwrap=section["bwrap"],
                   limits=Limits(**section["limits"]), network=section["network"],
                   allow_host_network=section["allow_host_network"],
                   egress=Egress(tuple(eg["allow"]), tuple(eg["deny"]),
                                 eg["max_connections"]),
                   quota=section["quota"], min_free_mb=section["min_free_mb"])


def host_toolsets(toolsets) -> list[str]:
    """The names in ``toolsets`` that reach the host when unconfined."""
    return [t for t in toolsets if t in HOST_TOOLSETS or t.startswith(HOST_TOOLSET_PREFIX)]

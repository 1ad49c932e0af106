"""``hermes.sandbox``: the settings of the launcher (docs/sandbox.md; each key's meaning in
config.yaml), the modes and networks it knows, and the toolsets that reach the host."""
from __future__ import annotations

from dataclasses import dataclass

from ..config_fields import POS_INT, POS_NUM, STR_LIST, key, section
from .net.egress_policy import Policy

#: The environment variables a Hermes home's config.yaml names for the model: the
#: pass-through endpoint's URL and this process's credential there (homes/users.py).
MODEL_URL_ENV = "HERMES_SERVICE_MODEL_URL"
MODEL_KEY_ENV = "HERMES_SERVICE_MODEL_KEY"

MODES = ("auto", "bwrap", "none")
#: ``hermes.sandbox.network``: ``isolated`` — a network namespace of its own per sandbox,
#: the service reached over Unix sockets (:mod:`hermes_service.sandbox.net.sockets`); ``host`` — the
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
    memory_mb: int = key(2048, {"type": "integer", "minimum": 256})
    processes: int = key(256, {"type": "integer", "minimum": 32})
    cpu_seconds: int = key(600, {"type": "integer", "minimum": 10})
    file_size_mb: int = key(512, POS_INT)
    open_files: int = key(1024, {"type": "integer", "minimum": 64})
    tmp_mb: int = key(256, POS_INT)


@dataclass(frozen=True)
class Egress:
    """``hermes.sandbox.egress``: ``allow``/``deny`` destinations of the egress proxy
    (:mod:`hermes_service.sandbox.net.egress_policy`; empty ``allow``: no internet) and
    ``max_connections`` one sandbox may hold open through it; ``max_lookups`` name lookups
    it may have in flight at once and the seconds each may take (``lookup_timeout``), on
    threads of its own (:mod:`hermes_service.sandbox.net.lookups`)."""
    allow: tuple[str, ...] = key((), STR_LIST)
    deny: tuple[str, ...] = key((), STR_LIST)
    max_connections: int = key(64, {"type": "integer", "minimum": 1, "maximum": 4096})
    max_lookups: int = key(4, {"type": "integer", "minimum": 1, "maximum": 64})
    lookup_timeout: float = key(5.0, {"type": "number", "exclusiveMinimum": 0, "maximum": 60})

    def policy(self) -> Policy:
        """Raises ValueError for an entry the policy cannot read (config checks it first)."""
        return Policy.from_lists(self.allow, self.deny)


@dataclass(frozen=True)
class Settings:
    """``hermes.sandbox``: see config.yaml for each key."""
    mode: str = key("auto", {"enum": list(MODES)})
    allow_host_tools: bool = key(False, {"type": "boolean"})
    max_home_mb: float = key(2048, POS_NUM)
    #: how max_home_mb holds during a turn (disk/quota.py)
    quota: str = key("auto", {"enum": ["auto", "btrfs", "image", "watch"]})
    #: the free-space floor of the data and homes file systems
    min_free_mb: float = key(512, {"type": "number", "minimum": 0})
    bwrap: str = key("bwrap", {"type": "string", "minLength": 1})
    limits: Limits = section(Limits)
    network: str = key("isolated", {"enum": list(NETWORKS)})
    allow_host_network: bool = key(False, {"type": "boolean"})
    egress: Egress = section(Egress)


def host_toolsets(toolsets) -> list[str]:
    """The names in ``toolsets`` that reach the host when unconfined."""
    return [t for t in toolsets if t in HOST_TOOLSETS or t.startswith(HOST_TOOLSET_PREFIX)]

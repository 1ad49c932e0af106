"""The one launcher of every Hermes process: CLI turns, warm ``hermes acp`` processes and their
pre-warm, ``/api/v1/execute``, ``hermes --version`` and ``gc``'s transcript deletion
(docs/sandbox.md: the modes, what a sandboxed process sees, its limits).

* :mod:`.settings` — ``hermes.sandbox``: modes, networks, limits, egress, host toolsets;
* :mod:`.probe` — whether bubblewrap works here; the problems and warnings of the settings;
* :mod:`.args` — the arguments of a sandbox: namespaces, the runtime, ``/proc``, paths;
* :mod:`.cgroups` — one cgroup per sandbox: limits, events, CPU time, removal;
* :mod:`.trees` — a sandbox's process tree: memory, CPU, signals, strays, rlimit signals;
* :mod:`.seccomp_filter` — the seccomp filter every sandbox gets;
* :mod:`.hermes_policy` — what Hermes may do inside: the policy surface of its home's config;
* :mod:`.net` — a sandbox's network: its sockets, the egress policy and proxy, the service gate;
* :mod:`.launcher` — :class:`Sandbox` and the :class:`Launch` of one process.

It may import the core's leaves (:mod:`hermes_service.config_fields`,
:mod:`hermes_service.homefs`), its own :mod:`.net`, and the pass-through's record of a
turn's calls as a type (``model_proxy.calls``); never ``disk/``, ``homes/``, the runners
or the web. What a home takes on disk is :mod:`hermes_service.disk.use`.
"""
from .args import HOME, RUN_DIR, SITE_DIR, map_paths, proc_covers, runtime_roots
from .cgroups import Cgroup, CgroupBase
from .launcher import Credentials, Launch, Sandbox
from .probe import Probe, fallback_warnings, probe, problems, warnings
from .settings import (
    HOST_TOOLSETS,
    MODEL_KEY_ENV,
    MODEL_URL_ENV,
    MODES,
    NETWORKS,
    Egress,
    Limits,
    Settings,
    host_toolsets,
)
from .trees import (
    descendants,
    kill_strays,
    limit_signal,
    signal_tree,
    tree_cpu_seconds,
    tree_rss_mb,
    zombies,
)

__all__ = [
    "HOME",
    "HOST_TOOLSETS",
    "MODEL_KEY_ENV",
    "MODEL_URL_ENV",
    "MODES",
    "NETWORKS",
    "RUN_DIR",
    "SITE_DIR",
    "Cgroup",
    "CgroupBase",
    "Credentials",
    "Egress",
    "Launch",
    "Limits",
    "Probe",
    "Sandbox",
    "Settings",
    "descendants",
    "fallback_warnings",
    "host_toolsets",
    "kill_strays",
    "limit_signal",
    "map_paths",
    "probe",
    "problems",
    "proc_covers",
    "runtime_roots",
    "signal_tree",
    "tree_cpu_seconds",
    "tree_rss_mb",
    "warnings",
    "zombies",
]

"""Service configuration: load ``config.yaml``, validate it, resolve defaults (docs/configuring.md).

The file follows the spec's example config (hermes-service-api-v1.3.0 §配置文件) plus the
service's own keys and the sections the installed extensions bring. Every key is declared
once, with its default and its schema, on the field of its section's settings class
(:mod:`hermes_service.config_fields`); the schema and the defaults are read off those classes.

* :mod:`.sections` — the core's sections (security, nginx, service, cors, hermes, paths,
  retention) and their keys; the restart-only ones;
* :mod:`.model` — :class:`Config` and the sizes derived from it, :class:`ConfigError`, and
  :class:`ConfigSection`, the section an extension brings (with its checks and threads);
* :mod:`.resolve` — the values resolved: networks, API keys, paths, the provider's usability;
* :mod:`.checks` — the cross-key checks;
* :mod:`.loading` — reading, validating and building a config, in one pass;
* :mod:`.reload` — what a live reload applies.

This package imports no extension: the installed ones are passed by the composition point,
:mod:`hermes_service.installed`. Nothing outside it reads the YAML's mapping.
"""
from ..config_fields import POS_INT, POS_NUM, STR_LIST, object_schema, settings_from
from .checks import CHECKS, HERMES_MIN_CONTEXT_LENGTH, MIN_SESSION_AGE_SECONDS, run_checks
from .loading import ENV_CONFIG, build_config, defaults, load_config, schema
from .model import (
    SPARE_CONNECTIONS,
    Check,
    Config,
    ConfigError,
    ConfigSection,
    ThreadNeed,
    is_invalid,
)
from .reload import keep_running, restart_only
from .resolve import (
    DEV_KEY_ENV,
    DEV_KEY_FILE,
    PLACEHOLDER_PROVIDERS,
    dev_key_hint,
    env_unset,
    parse_network,
    provider_issues,
)
from .sections import (
    CORE_SECTIONS,
    DEFAULT_SCOPES,
    DEFAULTS,
    DURATION_PATTERN,
    NODE_ID_PATTERN,
    RESTART_ONLY,
    SCHEMA,
    SCOPES,
    AcpSettings,
    ApiKey,
    ApprovalSettings,
    CorsSettings,
    ExecuteSettings,
    HermesSettings,
    ModelSettings,
    NginxSettings,
    PathsSettings,
    RetentionSettings,
    SecuritySettings,
    ServiceSettings,
    StorageSettings,
    UsageLimits,
    parse_duration,
)

__all__ = [
    "CHECKS",
    "CORE_SECTIONS",
    "DEFAULTS",
    "DEFAULT_SCOPES",
    "DEV_KEY_ENV",
    "DEV_KEY_FILE",
    "DURATION_PATTERN",
    "ENV_CONFIG",
    "HERMES_MIN_CONTEXT_LENGTH",
    "MIN_SESSION_AGE_SECONDS",
    "NODE_ID_PATTERN",
    "PLACEHOLDER_PROVIDERS",
    "POS_INT",
    "POS_NUM",
    "RESTART_ONLY",
    "SCHEMA",
    "SCOPES",
    "SPARE_CONNECTIONS",
    "STR_LIST",
    "AcpSettings",
    "ApiKey",
    "ApprovalSettings",
    "Check",
    "Config",
    "ConfigError",
    "ConfigSection",
    "CorsSettings",
    "ExecuteSettings",
    "HermesSettings",
    "ModelSettings",
    "NginxSettings",
    "PathsSettings",
    "RetentionSettings",
    "SecuritySettings",
    "ServiceSettings",
    "StorageSettings",
    "ThreadNeed",
    "UsageLimits",
    "build_config",
    "defaults",
    "dev_key_hint",
    "env_unset",
    "is_invalid",
    "keep_running",
    "load_config",
    "object_schema",
    "parse_duration",
    "parse_network",
    "provider_issues",
    "restart_only",
    "run_checks",
    "schema",
    "settings_from",
]

"""What a live reload applies (docs/configuring.md §Reload): the restart-only keys that
changed, and the new config with their running values kept."""
from __future__ import annotations

from dataclasses import replace

from .checks import run_checks
from .model import Config, ConfigError, with_sections


def _value(cfg: Config, section: str, key: str | None):
    """The running value of ``section.key`` (the whole section when ``key`` is None); one a
    command-line option overrode is the file's value it was started with."""
    if (section, key) in cfg.overrides:
        return cfg.overrides[(section, key)]
    return getattr(cfg.section(section), key) if key else cfg.section(section)


def restart_only(running: Config, new: Config) -> list[str]:
    """Dotted keys whose new value a live reload cannot apply (docs/configuring.md §Reload;
    :attr:`Config.restart_only_keys`). A key a command-line option overrode is compared with
    the file's value it was started with."""
    return [f"{section}.{key}" if key else section for section, key in running.restart_only_keys
            if _value(running, section, key) != _value(new, section, key)]


def keep_running(running: Config, new: Config) -> Config:
    """``new`` with the running values of the restart-only settings
    (:attr:`Config.restart_only_keys`, and the running command-line overrides and overlay), as
    a reload applies it (docs/configuring.md §Reload).

    Raises :class:`ConfigError` with the :func:`run_checks` problems of the result: the new
    limits must fit the running threads and connections."""
    sections: dict = {}
    for section, key in running.restart_only_keys:
        value = running.section(section)
        if key is not None:
            value = replace(sections.get(section, new.section(section)),
                            **{key: getattr(value, key)})
        sections[section] = value
    kept = with_sections(new, sections, overrides=running.overrides, overlay=running.overlay)
    problems = run_checks(kept)
    if problems:
        raise ConfigError(problems)
    return kept

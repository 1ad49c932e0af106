"""An extension's config section (docs/configuring.md §Extension sections): the core's config
machinery treats any :class:`~hermes_service.config.ConfigSection` as it treats mnote's — the
schema and its hints, defaults, typed settings, named checks, restart-only keys and the
threads it holds. Shown with a made-up second section beside the installed ones."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hermes_service import config, installed
from hermes_service.config import (
    POS_INT,
    Check,
    ConfigError,
    ConfigSection,
    ThreadNeed,
    object_schema,
    settings_from,
)
from support.fixtures import base_config, deep_merge


@dataclass(frozen=True)
class Extra:
    url: str
    workers: int
    mode: str


def _too_many(cfg):
    extra = cfg.section("extra")
    if extra.mode == "solo" and extra.workers > 1:
        return [f"{cfg.source}:extra.workers: solo mode runs one worker"]
    return []


EXTRA = ConfigSection(
    "extra",
    object_schema({"url": {"type": "string"}, "workers": POS_INT, "mode": {"enum": ["solo", "team"]}}),
    {"url": "http://x", "workers": 3, "mode": "team"},
    lambda mapping, valid: settings_from(Extra, mapping),
    checks=(Check("extra_solo", ("extra.workers", "extra.mode"), _too_many),),
    restart_only=("url",),
    threads=(ThreadNeed("extra.workers", "workers", lambda e: e.workers),))


def build(tmp_path, over=None, **kw):
    sections = (*installed.config_sections(), EXTRA)
    base = deep_merge(base_config(tmp_path), {"service": {"threads": 40},
                                              "mnote": {"max_event_streams": 12}})
    return config.build_config(deep_merge(base, over or {}), sections=sections, **kw)


def problems(tmp_path, over) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build(tmp_path, over)
    return info.value.problems


def test_its_defaults_and_typed_settings(tmp_path):
    cfg = build(tmp_path, {"extra": {"workers": 5}})
    assert cfg.section("extra") == Extra("http://x", 5, "team") == cfg.extensions["extra"]
    assert cfg.section("service") is cfg.service
    with pytest.raises(KeyError):
        cfg.section("nothing")
    # its threads count, after mnote's: 12 event streams + 5 workers + 2 * 2 + 4 + 4
    assert cfg.threads_needed == 12 + 5 + 2 * 2 + 4 + 4


def test_its_keys_are_refused_with_the_same_lines_and_hints(tmp_path):
    assert problems(tmp_path, {"extra": {"workers": 0, "urll": "y"}}) == [
        "<dict>:extra: unknown key 'urll' (did you mean 'url'?)",
        "<dict>:extra.workers: 0 is less than the minimum of 1"]
    # the sections sit before retention, in the order they are given
    assert problems(tmp_path, {"zzz": 1}) == [
        "<dict>:(top): unknown key 'zzz' (known: security, nginx, service, cors, hermes, "
        "paths, storage, mnote, openai, extra, retention)"]


def test_its_checks_run_after_the_cores_and_are_skipped_on_a_refused_key(tmp_path):
    solo = {"extra": {"mode": "solo"}, "cors": {"allow_origins": ["*"], "allow_credentials": True}}
    assert [p.split(":")[1] for p in problems(tmp_path, solo)] == ["cors.allow_origins",
                                                                   "extra.workers"]
    assert problems(tmp_path, {"extra": {"mode": "solo", "workers": "2"}}) == [
        "<dict>:extra.workers: '2' is not of type 'integer'"]


def test_its_threads_are_named_in_the_thread_and_connection_checks(tmp_path):
    assert problems(tmp_path, {"service": {"threads": 20}}) == [
        "<dict>:service.threads: 20 is too few; event streams, workers, v1 turns (running and "
        "waiting) and tool calls each hold a thread (need >= 27 = mnote.max_event_streams + "
        "extra.workers + 2 * hermes.max_concurrent_runs + hermes.max_waiting_requests + 4)"]
    assert problems(tmp_path, {"service": {"threads": 200, "connection_limit": 250}}) == [
        "<dict>:service.connection_limit: 250 is too few; every thread (service.threads: 200, "
        "which includes the 12 of mnote.max_event_streams and the 3 of extra.workers) can "
        "hold one, and idle or queued connections need room beyond them (need >= 300 = "
        "service.threads + 100)"]


def test_its_restart_only_keys_keep_their_running_values_on_reload(tmp_path):
    running = build(tmp_path)
    new = build(tmp_path, {"extra": {"url": "http://y", "workers": 4},
                           "mnote": {"runner": "acp"}})
    assert running.restart_only_keys[-1] == ("extra", "url")
    assert config.restart_only(running, new) == ["mnote.runner", "extra.url"]
    kept = config.keep_running(running, new)
    assert kept.section("extra") == Extra("http://x", 4, "team")        # workers applies
    assert kept.section("mnote").runner == "cli" and kept.extension_sections == new.extension_sections
    overridden = running.override("extra", "url", "http://z")
    assert overridden.section("extra").url == "http://z"
    assert config.restart_only(overridden, running) == []             # the file's value counts


def test_two_sections_may_not_share_a_name(tmp_path):
    with pytest.raises(ValueError, match="share a name"):
        config.build_config({}, sections=(EXTRA, EXTRA))
    with pytest.raises(ValueError, match="share a name"):
        config.build_config({}, sections=(ConfigSection("service", {}, {}, dict),))

"""The limits a config leaves null, sized for the machine (hermes_service/config/sizing.py;
docs/scaling.md §Sizing a node): derived by the rule, an explicit value kept, check-config's
lines naming the numbers."""
from __future__ import annotations

from hermes_service.config import sizing
from hermes_service.installed import build_config
from hermes_service.machine import Machine

OPEN = {"security": {"enable_api_key": False}}


def test_the_rule_for_a_small_and_a_large_machine():
    small = build_config(OPEN, machine=Machine(1, 2048))
    assert small.hermes.max_concurrent_runs == 1
    assert small.hermes.acp.min_available_mb == 256                  # the floor's least
    assert small.hermes.acp.max_processes == (2048 - 256 - 200 - 256) // 150
    big = build_config(OPEN, machine=Machine(64, 512 * 1024))
    assert big.hermes.acp.min_available_mb == 2048                   # the floor's most
    assert big.hermes.acp.max_processes == sizing.MAX_AUTO_PROCESSES
    assert big.service.threads == big.threads_needed
    assert big.service.connection_limit == big.service.threads + 100 > 500
    tiny = build_config(OPEN, machine=Machine(1, 512))
    assert tiny.hermes.acp.max_processes == 1                        # never none


def test_an_explicit_limit_is_kept_and_not_called_derived():
    cfg = build_config({**OPEN, "hermes": {"max_concurrent_runs": 3, "acp": {"max_processes": 5}},
                        "service": {"threads": 100}}, machine=Machine(2, 24576))
    assert (cfg.hermes.max_concurrent_runs, cfg.hermes.acp.max_processes,
            cfg.service.threads) == (3, 5, 100)
    assert not {"hermes.max_concurrent_runs", "hermes.acp.max_processes",
                "service.threads"} & set(cfg.sizing.auto)
    # the derived event streams fit in the threads the file gave
    assert cfg.threads_needed <= 100


def test_check_config_lines_name_the_machine_the_rule_and_the_numbers():
    cfg = build_config(OPEN, machine=Machine(2, 24576))
    lines = sizing.explain(cfg)
    assert lines[0] == "machine: 2 cores, 24576 MiB (meminfo)"
    text = "\n".join(lines)
    assert f"hermes.acp.max_processes: {cfg.hermes.acp.max_processes} (derived; rule: " \
           f"(24576 − 256 service − 2 × 200 CLI − 1536 floor) / 150" in text
    assert f"client runs active at once: {cfg.hermes.acp.max_processes + 8}" in text
    assert f"service.threads: {cfg.service.threads} (derived" in text
    assert "2 turn slots" in sizing.summary(cfg)

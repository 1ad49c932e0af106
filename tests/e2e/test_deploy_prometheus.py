"""deploy/prometheus/alerts.yml and deploy/grafana/hermes-service.json (docs/operations.md
§Alerts and dashboard): promtool checks and unit-tests the rules (alerts_test.yml), and every
metric a rule or a dashboard query names is one the service exports — read from the app's
own /metrics after a request or two (in-process, a stub at the runner seam)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.fixtures import API_KEY, ROOT

RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "hermes-service.json"
K = {"X-API-Key": API_KEY}

#: metrics Prometheus makes itself for every target
PROMETHEUS_OWN = {"up"}
#: metrics a rule names that this branch does not export yet, each with why. Remove an entry
#: once the service exports it (this test then fails until it is removed).
NOT_YET_EXPORTED: set = set()
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
            "group_right", "offset", "bool", "inf", "nan"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make setup` "
                    "installs it as root): deploy/prometheus/alerts.yml was not checked")
    return found


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([tool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                           capture_output=True, text=True, timeout=120)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every rule and every dashboard query (targets, variables)."""
    out = [(f"alerts.yml {r['alert']}", r["expr"])
           for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"dashboard panel {p['title']!r}", t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*[A-Za-z_]\w*\)", query)   # Grafana's own
            out.append((f"dashboard variable {var['name']}", m.group(1) if m else query))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: what is left once strings, label matchers,
    ranges, grouping label lists, function names and keywords are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in KEYWORDS:
            continue                       # a function, or an operator word
        names.add(m.group())
    return names


def exported(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can show, by metric family (a labelled family
    with no sample yet still declares its type)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("", "_sum", "_count")}.get(fam.type, ("",))
        names.update(fam.name + s for s in suffixes)
    return names


def test_every_metric_of_the_rules_and_the_dashboard_is_exported(stubbed_app):
    c = stubbed_app().test_client()
    sid = c.post("/api/v1/sessions", json={"user_id": "ops"}, headers=K).json["session_id"]
    assert c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"},
                  headers=K).status_code == 200
    assert c.get("/health").status_code == 200
    res = c.get("/metrics", headers=K)
    assert res.status_code == 200, res.get_data(as_text=True)
    have = exported(res.get_data(as_text=True))
    assert {"hermes_service_turns_total", "hermes_service_draining",
            "hermes_service_event_streams_max", "process_resident_memory_bytes"} <= have

    missing = {}
    for where, expr in queries():
        names = metric_names(expr)
        assert names, f"{where}: names no metric: {expr}"
        for name in names - have - PROMETHEUS_OWN - NOT_YET_EXPORTED:
            missing.setdefault(name, []).append(where)
    assert not missing, f"metrics the service does not export: {missing}"
    named = {n for _, expr in queries() for n in metric_names(expr)}
    for name in NOT_YET_EXPORTED:
        assert name not in have, f"{name} is exported now: remove it from NOT_YET_EXPORTED"
        assert name in named, f"{name} is no longer used: remove it from NOT_YET_EXPORTED"

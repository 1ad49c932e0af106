"""Live reload (docs/configuring.md §Reload): SIGHUP and ``main.py reload`` re-read config.yaml; an invalid
file is refused with its problems and the running config stays; runs in flight go on."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import yaml

from support.fixtures import API_KEY, ROOT, base_config

NEW_KEY = "the-new-key-0123456789"


#: said at every start and reload while the service runs as root (as the tests do here)
ROOT_WARNING = "the service runs as root"


def wait_reloaded(svc, seq: int, timeout: float = 15.0) -> dict:
    path = svc.data_dir / "service-pids" / f"{svc.proc.pid}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = json.loads(path.read_text())["reload"]
            if status["seq"] >= seq:
                return status
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no reload #{seq} reported:\n{svc.log()}")


def write(svc, cfg: dict | str) -> None:
    svc.config_path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))


def reload_cmd(svc):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(svc.config_path),
                           "reload"], capture_output=True, text=True, timeout=60, env=svc.env)


def test_sighup_swaps_a_key_and_survives_a_broken_file(start_service):
    svc = start_service()
    assert svc.get("/api/v1/sessions?user_id=a").status_code == 200
    cfg = json.loads(json.dumps(svc.cfg))
    cfg["security"]["api_keys"] = [{"key": NEW_KEY, "scopes": ["v1"]}]
    cfg["hermes"]["max_message_bytes"] = 1000
    write(svc, cfg)
    os.kill(svc.proc.pid, signal.SIGHUP)
    assert wait_reloaded(svc, 1)["ok"] is True
    assert svc.get("/api/v1/sessions?user_id=a").status_code == 401           # old key gone
    assert svc.get("/api/v1/sessions?user_id=a", key=NEW_KEY).status_code == 200
    sid = svc.post("/api/v1/sessions", json={"user_id": "a"}, key=NEW_KEY).json()["session_id"]
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "x" * 1001}, key=NEW_KEY)
    assert res.status_code == 413 and res.json()["code"] == "message_too_large"   # new limit

    broken = yaml.safe_dump(cfg).replace("enable_ip_check: true", "enable_ip_chek: true") \
        .replace("- 127.0.0.1", "- 127.0.0.1/8.1")
    write(svc, broken)
    os.kill(svc.proc.pid, signal.SIGHUP)
    status = wait_reloaded(svc, 2)
    assert status["ok"] is False
    assert f"{svc.config_path}:security: unknown key 'enable_ip_chek' (did you mean " \
           "'enable_ip_check'?)" in status["lines"]
    svc.wait_log(f"reload refused: {svc.config_path}:security: unknown key 'enable_ip_chek'")
    assert svc.get("/api/v1/sessions?user_id=a", key=NEW_KEY).status_code == 200   # still running
    assert svc.get("/api/v1/sessions?user_id=a").status_code == 401

    res = reload_cmd(svc)                          # the operator command refuses it as well
    assert res.returncode == 2 and "unknown key 'enable_ip_chek'" in res.stderr


def test_reload_command_applies_and_names_what_needs_a_restart(start_service):
    svc = start_service()
    cfg = json.loads(json.dumps(svc.cfg))
    cfg["security"]["api_keys"].append({"key": NEW_KEY})
    cfg["service"]["threads"] = 40                 # restart only: noted, running value stays
    cfg["hermes"]["model"]["context_length"] = 16000
    write(svc, cfg)
    res = reload_cmd(svc)
    assert res.returncode == 2, res.stderr        # Hermes's minimum: refused, nothing applied
    assert f"pid {svc.proc.pid}: refused; the running config stays" in res.stderr
    assert "hermes.model.context_length: 16000" in res.stderr
    assert wait_reloaded(svc, 1)["ok"] is False   # the service was asked, and its log says so
    svc.wait_log(f"reload refused: {svc.config_path}:hermes.model.context_length: 16000")
    assert svc.get("/health", key=NEW_KEY).status_code == 200
    assert svc.get("/api/v1/sessions?user_id=a", key=NEW_KEY).status_code == 401
    cfg["hermes"]["model"]["context_length"] = 128000
    write(svc, cfg)
    res = reload_cmd(svc)
    assert res.returncode == 0, res.stderr
    assert f"pid {svc.proc.pid}: reloaded" in res.stdout
    assert f"{svc.config_path}:service.threads: changed, but needs a restart" in res.stdout
    assert svc.get("/api/v1/sessions?user_id=a", key=NEW_KEY).status_code == 200


def test_reload_command_with_a_file_that_is_not_yaml_still_asks_the_service(start_service,
                                                                              tmp_path):
    """No data dir can be read from the file: the services of data/ beside it that serve this
    file are asked (the test service's data dir is tmp/data, its config tmp/config-*.yaml)."""
    svc = start_service()
    other = start_service(tmp=tmp_path)          # another file on the same data dir: left alone
    assert svc.data_dir == tmp_path / "data" and svc.config_path.parent == tmp_path
    write(svc, "security:\n  api_keys: [\n")
    res = reload_cmd(svc)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"pid {svc.proc.pid}: refused; the running config stays" in res.stderr
    [problem] = [line.strip() for line in res.stderr.splitlines() if "YAML syntax error" in line]
    assert problem.startswith(f"{svc.config_path}:")
    assert wait_reloaded(svc, 1)["ok"] is False
    svc.wait_log(f"reload refused: {problem}")
    assert f"pid {other.proc.pid}" not in res.stderr and "reload refused" not in other.log()
    record = other.data_dir / "service-pids" / f"{other.proc.pid}.json"
    assert json.loads(record.read_text())["reload"]["seq"] == 0
    assert svc.get("/health").status_code == 200          # still serving the old config

    svc.stop()
    other.stop()
    res = reload_cmd(svc)                       # nobody to ask: the command says it itself
    assert res.returncode == 2 and problem in res.stderr
    assert "no running service found" in res.stderr


def test_reload_does_not_disturb_a_turn_in_flight(stubbed_app, stub, tmp_path):
    from hermes_service.lifecycle import reload_config
    app = stubbed_app()
    svc = app.extensions["hermes_service"]
    client = app.test_client()
    headers = {"X-API-Key": API_KEY}
    sid = client.post("/api/v1/sessions", json={"user_id": "alice"}, headers=headers).json["session_id"]
    stub.gate = threading.Event()
    out = {}
    t = threading.Thread(target=lambda: out.update(res=client.post(
        f"/api/v1/sessions/{sid}/messages", json={"message": "in flight"}, headers=headers)))
    t.start()
    while not stub.calls:
        time.sleep(0.01)
    cfg = base_config(tmp_path)
    cfg["hermes"].update(max_concurrent_runs=1, timeout_seconds=5, toolsets=["web"])
    cfg["security"]["api_keys"] = [{"key": NEW_KEY, "scopes": ["v1"]}]
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ok, lines = reload_config(svc, str(path))
    assert ok, lines
    assert svc.processes.timeout == 5 and svc.processes.toolsets == ["web"]
    stub.gate.set()
    t.join(10)
    assert out["res"].status_code == 200 and out["res"].json["response"] == "echo #1: in flight"
    assert svc.config.hermes.toolsets == ("web",)
    res = client.post(f"/api/v1/sessions/{sid}/messages", json={"message": "next"},
                      headers={"X-API-Key": NEW_KEY})
    assert res.status_code == 200
    assert "-t" in stub.calls[-1]["args"] and "web" in stub.calls[-1]["args"]


def test_a_reload_retires_warm_acp_processes_only_when_hermes_or_the_template_changed(
        app_factory, tmp_path, monkeypatch):
    """Rotating a key (or any change outside ``hermes`` and the template) keeps every
    user's warm ACP process: retiring them all made every user's next turn a cold start
    (~3-5 s and a burst of process starts) for nothing."""
    from hermes_service.lifecycle import reload_config
    acp = {"hermes": {"runner": "acp"}}
    svc = app_factory(acp).extensions["hermes_service"]
    retired = []
    monkeypatch.setattr(svc.runners.acp, "configure",
                        lambda h, retire=True: retired.append(retire))
    path = tmp_path / "new.yaml"

    def reload(cfg):
        path.write_text(yaml.safe_dump(cfg))
        ok, lines = reload_config(svc, str(path))
        assert ok, lines
        return retired[-1]
    cfg = base_config(tmp_path)
    cfg["hermes"]["runner"] = "acp"
    cfg["security"]["api_keys"].append({"key": NEW_KEY, "scopes": ["v1"]})
    assert reload(cfg) is False                          # a new key: processes stay warm
    cfg["hermes"]["model"]["default"] = "another-model"
    assert reload(cfg) is True                           # the model changed
    template = tmp_path / "template"
    import shutil
    shutil.copytree(ROOT / "users_template", template)
    cfg["paths"]["users_template"] = str(template)
    assert reload(cfg) is False                          # the same files elsewhere
    (template / "config.yaml").write_text((template / "config.yaml").read_text() + "\n# edited\n")
    assert reload(cfg) is True                           # the template's files changed


def test_a_reload_keeps_log_format_and_node_id_and_says_they_need_a_restart(stubbed_app, tmp_path):
    # the log handlers are set up once at start and node_id is the data dir's tag: a reload
    # that changes them must say so instead of applying node_id and silently ignoring the format
    from hermes_service.lifecycle import reload_config
    svc = stubbed_app().extensions["hermes_service"]
    cfg = base_config(tmp_path)
    cfg["service"].update(log_format="json", node_id="n2")
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ok, lines = reload_config(svc, str(path))
    assert ok, lines
    for key in ("service.log_format", "service.node_id"):
        assert f"{path}:{key}: changed, but needs a restart; the running value stays" in lines
    assert svc.config.service.log_format == "text" and svc.config.service.node_id is None


def test_a_threads_override_is_kept_and_not_reported_as_a_change(stubbed_app, tmp_path):
    """``main.py --threads N`` runs waitress with N: a reload of the unchanged file keeps N
    without a "needs a restart" note (it compares the file with the file it started with);
    a changed ``service.threads`` in the file is reported, and N stays."""
    from hermes_service.lifecycle import reload_config
    svc = stubbed_app().extensions["hermes_service"]
    cfg = base_config(tmp_path)
    path = tmp_path / "same.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started_with = svc.config.service.threads
    svc.config = svc.config.override("service", "threads", started_with + 40)   # as serve() does
    for _ in range(2):
        ok, lines = reload_config(svc, str(path))
        assert ok and not any("service.threads" in line for line in lines), lines
        assert svc.config.service.threads == started_with + 40
    cfg["service"]["threads"] = started_with + 1
    path.write_text(yaml.safe_dump(cfg))
    ok, lines = reload_config(svc, str(path))
    assert ok and f"{path}:service.threads: changed, but needs a restart; the running value stays" \
        in lines
    assert svc.config.service.threads == started_with + 40


def test_a_refused_reload_lists_every_problem_at_once(stubbed_app, tmp_path):
    from hermes_service.lifecycle import reload_config
    svc = stubbed_app().extensions["hermes_service"]
    cfg = base_config(tmp_path)
    cfg["hermes"]["timeout_seconds"] = "long"                                 # schema
    cfg["hermes"]["model"]["context_length"] = 16000                          # cross-field
    cfg["paths"]["users_template"] = str(tmp_path / "no-such-template")       # what it names
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ok, lines = reload_config(svc, str(path))
    assert not ok
    assert sorted(line.split(": ")[0] for line in lines) == [
        f"{path}:{k}" for k in ("hermes.model.context_length", "hermes.timeout_seconds",
                                "paths.users_template")], lines


def test_the_start_and_reload_lines_say_what_runs_and_the_readme_quotes_them(start_service):
    """One start line and one reload line (docs/operations.md §Logs): runner, model, provider host (never
    the key or the URL's path), sandbox, data dir and listen address; a reload to an unusable
    provider logs the same "no model provider" line as a start."""
    from hermes_service.lifecycle import no_provider
    svc = start_service()
    host = svc.cfg["hermes"]["model"]["base_url"].split("//")[1].split("/")[0]
    said = f"serving on {svc.url} (pid {svc.proc.pid}): runner cli (panel cli) (openai acp), "
    [start] = [line for line in svc.wait_log(" serving on ").splitlines() if " serving on " in line]
    assert f" INFO hermes_service {said}model scripted-model at {host}, sandbox " in start
    assert start.endswith(f", data dir {svc.data_dir}")
    cfg = json.loads(json.dumps(svc.cfg))
    cfg["hermes"]["model"].update(default="other-model", api_key_env="HERMES_TEST_UNSET_KEY")
    write(svc, cfg)
    os.kill(svc.proc.pid, signal.SIGHUP)
    assert wait_reloaded(svc, 1)["ok"] is True
    log = svc.wait_log(" reloaded ", "no model provider").splitlines()   # the reload's lines
    [line] = [line for line in log if " reloaded " in line]
    assert f" INFO hermes_service reloaded {svc.config_path}; {said}model other-model at {host}, " \
           "sandbox " in line and line.endswith(f", data dir {svc.data_dir}")
    [warn] = [line for line in log if "no model provider" in line]
    assert f" WARNING hermes_service no model provider: {svc.config_path}:hermes.model." \
           "api_key_env: HERMES_TEST_UNSET_KEY is not set" in warn
    assert "sk-scripted" not in "\n".join(log)
    assert not any("reload: warning" in l and ROOT_WARNING not in l for l in log)
    manual = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    logs = (ROOT / "docs" / "operations.md").read_text().split("\n## Logs\n", 1)[1].split("\n## ", 1)[0]
    for quoted in (f" INFO hermes_service {said.split('(')[0].replace(svc.url, 'http://127.0.0.1:9123')}",
                   " INFO hermes_service reloaded ", "; serving on http://127.0.0.1:9123 (pid ",
                   " WARNING hermes_service no model provider: ",
                   warn.split(" — ", 1)[1]):
        assert quoted in logs, quoted
    assert no_provider.__doc__ and not any("no usable model provider:" in " ".join(p.read_text().split())
                                           for p in manual)

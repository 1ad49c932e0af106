"""Config loading, validation messages and the operator commands (docs/configuring.md)."""
import hashlib
import subprocess
import sys

import pytest
import yaml

from hermes_service.config import ConfigError
from hermes_service.installed import build_config, load_config
from support.fixtures import ROOT, base_config, deep_merge
from support.shipped import shipped_file, shipped_text


def problems(cfg: dict) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        build_config(cfg, source="c.yaml")
    return exc.value.problems


def test_shipped_config_is_valid(monkeypatch, tmp_path):
    monkeypatch.setenv("HERMES_SERVICE_API_KEY", "x" * 32)
    cfg = load_config(shipped_file("config.yaml", tmp_path / "config.yaml"))
    assert cfg.service.port == 9123 and cfg.service.host == "127.0.0.1"
    assert cfg.hermes.toolsets == ("terminal", "file", "code_execution", "todo", "memory")
    assert cfg.security.api_keys[0].sha256 == hashlib.sha256(b"x" * 32).hexdigest()


def test_spec_example_keys_are_all_accepted():
    # the example config of the spec (§配置文件), verbatim but with a longer key
    spec = yaml.safe_load("""
security:
  enable_ip_check: true
  allowed_ips: ["127.0.0.1", "203.0.113.7"]
  enable_api_key: true
  auth_method: "header"
  api_key_header: "X-API-Key"
  api_keys:
    - key: "your-api-key-0123456789"
      description: "Production key"
      expires_at: null
nginx:
  trusted_proxies: ["127.0.0.1"]
  enable_real_ip: false
service: {host: "127.0.0.1", port: 9123, log_level: "info"}
cors: {allow_origins: ["https://mnote.example"], allow_credentials: true,
       allow_methods: ["*"], allow_headers: ["*"]}
""")
    cfg = build_config(spec)
    assert [str(n) for n in cfg.security.allowed_networks] == ["127.0.0.1/32", "203.0.113.7/32"]


def test_unknown_key_names_the_key_and_hints():
    out = problems({"security": {"enable_ip_chek": True}})
    assert out == ["c.yaml:security: unknown key 'enable_ip_chek' (did you mean 'enable_ip_check'?)",
                   # and, in the same run, what the rest of the file lacks
                   "c.yaml:security.api_keys: enable_api_key is true but no key is configured "
                   "(run `.venv/bin/python main.py keygen`)"]


def test_every_problem_is_reported_as_file_key_problem():
    out = problems(deep_merge(base_config(ROOT), {
        "security": {"allowed_ips": ["10.0.0.0/33", "::1"],
                     "api_keys": [{"key": "k" * 20, "expires_at": "soon"}]},
        "cors": {"allow_origins": ["*"], "allow_credentials": True}}))
    assert any(p.startswith("c.yaml:security.allowed_ips.0:") for p in out)
    assert any(p.startswith("c.yaml:security.api_keys.0.expires_at:") for p in out)
    assert any(p.startswith("c.yaml:cors.allow_origins:") for p in out)


@pytest.mark.parametrize("bad, where", [
    ({"service": {"port": "80"}}, "service.port"),
    ({"service": {"drain_seconds": -1}}, "service.drain_seconds"),
    ({"service": {"drain_seconds": "60"}}, "service.drain_seconds"),
    ({"security": {"auth_method": "cookie"}}, "security.auth_method"),
    ({"security": {"api_keys": [{"key": "short"}]}}, "security.api_keys.0.key"),
    ({"security": {"api_keys": [{"key": "k" * 20, "key_sha256": "0" * 64}]}}, "security.api_keys.0"),
    ({"hermes": {"model": {"api_key_env": "NOT-A-NAME"}}}, "hermes.model.api_key_env"),
    ({"hermes": {"execute": {"allowed": [["chat"]]}}}, "hermes.execute.allowed.0"),
])
def test_bad_values_are_named(bad, where):
    out = problems(deep_merge(base_config(ROOT), bad))
    assert any(p.startswith(f"c.yaml:{where}:") for p in out), out


def test_key_env_and_sha256(monkeypatch):
    digest = hashlib.sha256(b"a-key-from-a-digest!").hexdigest()
    monkeypatch.setenv("K_ENV", "a-key-from-the-env!!")
    cfg = build_config(deep_merge(base_config(ROOT), {"security": {"api_keys": [
        {"key_sha256": digest}, {"key_env": "K_ENV"}]}}))
    assert [k.sha256 for k in cfg.security.api_keys] == [digest,
                                                hashlib.sha256(b"a-key-from-the-env!!").hexdigest()]
    monkeypatch.delenv("K_ENV")
    assert problems(deep_merge(base_config(ROOT), {"security": {"api_keys": [{"key_env": "K_ENV"}]}}))


def run_main(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=60)


def test_check_config_exits_non_zero_with_file_key_lines(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("security:\n  enable_ip_chek: true\nservice:\n  port: 99999\n")
    res = run_main("--config", str(bad), "check-config")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert f"{bad}:security: unknown key 'enable_ip_chek' (did you mean 'enable_ip_check'?)" in lines
    assert any(line.startswith(f"{bad}:service.port:") for line in lines)


def test_bad_config_never_starts_a_server(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("service: [not, a, mapping]\n")
    res = run_main("--config", str(bad), "--port", "0")
    assert res.returncode == 2 and "service" in res.stderr


def test_yaml_syntax_error_has_a_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("service:\n  port: [1\n")
    res = run_main("--config", str(bad), "check-config")
    assert res.returncode == 2 and f"{bad}:" in res.stderr and "YAML syntax error" in res.stderr


def test_check_config_ok(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base_config(tmp_path)))
    res = run_main("--config", str(good), "check-config")
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout


def test_keygen_prints_key_and_matching_digest():
    res = run_main("keygen")
    assert res.returncode == 0
    fields = dict(line.split(":", 1) for line in res.stdout.strip().splitlines())
    key, digest = fields["key"].strip(), fields["key_sha256"].strip()
    assert len(key) >= 32 and hashlib.sha256(key.encode()).hexdigest() == digest


def test_operator_commands_need_no_serving_key(tmp_path):
    cfg = base_config(tmp_path)
    cfg["security"]["api_keys"] = [{"key_env": "SURELY_UNSET_KEY_VAR"}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in __import__("os").environ.items() if k != "SURELY_UNSET_KEY_VAR"}
    res = run_main("--config", str(path), "mnote", "add-workspace", "ws_1", env=env)
    assert res.returncode == 0, res.stderr
    assert run_main("--config", str(path), "check-config", env=env).returncode == 2


# ---------------------------------------------------------------- connections, scopes, fail fast, limits
def test_key_with_surrounding_whitespace_can_never_match(monkeypatch):
    out = problems(deep_merge(base_config(ROOT), {"security": {"api_keys": [
        {"key": " a-key-with-a-space-0123"}]}}))
    assert any(p.startswith("c.yaml:security.api_keys.0.key:") and "whitespace" in p for p in out)
    monkeypatch.setenv("K_ENV", "a-key-from-the-env!!\n")
    out = problems(deep_merge(base_config(ROOT), {"security": {"api_keys": [{"key_env": "K_ENV"}]}}))
    assert any(p.startswith("c.yaml:security.api_keys.0.key_env:") and "whitespace" in p for p in out)


def test_cidr_with_host_bits_is_a_problem_that_names_both_readings():
    out = problems(deep_merge(base_config(ROOT), {"security": {"allowed_ips": ["10.0.0.1/8"]},
                                                  "nginx": {"trusted_proxies": ["2001:db8::1/32"]}}))
    assert any(p.startswith("c.yaml:security.allowed_ips.0:") and "10.0.0.0/8" in p
               and "10.0.0.1" in p for p in out), out
    assert any(p.startswith("c.yaml:nginx.trusted_proxies.0:") for p in out), out
    cfg = build_config(deep_merge(base_config(ROOT), {"security": {"allowed_ips": ["10.0.0.0/8",
                                                                                    "10.1.2.3"]}}))
    assert [str(n) for n in cfg.security.allowed_networks] == ["10.0.0.0/8", "10.1.2.3/32"]


def test_unquoted_yaml_date_is_explained(tmp_path):
    cfg = base_config(tmp_path)
    text = yaml.safe_dump(cfg).replace("description: tests", "description: tests\n    expires_at: 2027-01-01")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    [line] = exc.value.problems
    assert line.startswith(f"{path}:security.api_keys.0.expires_at: YAML reads the unquoted 2027-01-01")
    assert 'quote it: "2027-01-01"' in line and "datetime" not in line


def test_expired_key_is_a_warning_not_a_silent_pass():
    cfg = build_config(deep_merge(base_config(ROOT), {"security": {"api_keys": [
        {"key": "k" * 20, "expires_at": "2020-01-01T00:00:00Z"}, {"key": "j" * 20}]}}), source="c.yaml")
    assert any(w.startswith("c.yaml:security.api_keys.0.expires_at: 2020-01-01T00:00:00Z is in the past")
               for w in cfg.warnings), cfg.warnings


def test_context_length_below_hermes_minimum_is_refused():
    out = problems(deep_merge(base_config(ROOT), {"hermes": {"model": {"context_length": 16000}}}))
    assert any(p.startswith("c.yaml:hermes.model.context_length: 16000 is below Hermes's minimum "
                            "of 64000") for p in out), out
    build_config(deep_merge(base_config(ROOT), {"hermes": {"model": {"context_length": 64000}}}))


def test_connection_limit_must_fit_threads_and_streams():
    out = problems(deep_merge(base_config(ROOT), {"service": {"threads": 24, "connection_limit": 100}}))
    assert any(p.startswith("c.yaml:service.connection_limit: 100 is too few") and "124" in p
               and "mnote.max_event_streams" in p for p in out), out
    cfg = build_config(base_config(ROOT))
    assert cfg.service.connection_limit >= 500 and cfg.service.idle_timeout_seconds <= 20


def test_the_1000_subscriber_settings_the_readme_recommends_pass_and_fit():
    """docs/mnote-client.md §Event-stream fan-out; bench/stream_fanout.py runs with these."""
    profile = {"mnote": {"max_event_streams": 1000},
               "service": {"threads": 1024, "connection_limit": 1200}}
    cfg = build_config(deep_merge(base_config(ROOT), profile))
    from hermes_service.preflight import fds_needed
    assert fds_needed(cfg) == 1400
    for key, value in (("threads", 1011), ("connection_limit", 1123)):
        too_few = deep_merge(base_config(ROOT), {**profile, "service": {
            **profile["service"], key: value}})
        assert any(p.startswith(f"c.yaml:service.{key}: {value} is too few")
                   for p in problems(too_few)), key


def test_scopes_default_and_validation():
    cfg = build_config(deep_merge(base_config(ROOT), {"security": {"api_keys": [
        {"key": "k" * 20}, {"key": "j" * 20, "scopes": ["client"]}]}}))
    assert cfg.security.api_keys[0].scopes == {"v1", "client"} and cfg.security.api_keys[1].scopes == {"client"}
    out = problems(deep_merge(base_config(ROOT), {"security": {"api_keys": [
        {"key": "k" * 20, "scopes": ["admin"]}]}}))
    assert any(p.startswith("c.yaml:security.api_keys.0.scopes.0:") for p in out), out


@pytest.mark.parametrize("model, where", [
    ({"base_url": None}, "hermes.model.base_url"),
    ({"base_url": "http://127.0.0.1:8000/v1", "default": "gpt-4o-mini"}, "hermes.model.base_url"),
    ({"api_key_env": "SURELY_UNSET_PROVIDER_KEY"}, "hermes.model.api_key_env"),
])
def test_unusable_provider_is_a_warning_the_service_acts_on(model, where):
    cfg = build_config(deep_merge(base_config(ROOT), {"hermes": {"model": model}}), source="c.yaml")
    assert [i.split(": ")[0] for i in cfg.provider_issues] == [f"c.yaml:{where}"]
    assert set(cfg.provider_issues) <= set(cfg.warnings)


def test_shipped_config_has_no_provider_until_the_admin_sets_one(monkeypatch, tmp_path):
    monkeypatch.setenv("HERMES_SERVICE_API_KEY", "x" * 32)
    monkeypatch.delenv("HERMES_PROVIDER_API_KEY", raising=False)
    cfg = load_config(shipped_file("config.yaml", tmp_path / "config.yaml"))
    issues = " ".join(cfg.provider_issues)
    assert "hermes.model.base_url" in issues and "export HERMES_PROVIDER_API_KEY=" in issues
    [operator] = cfg.security.api_keys
    assert operator.scopes == {"v1", "client", "execute", "metrics"}
    text = shipped_text("config.yaml")
    example = text[text.index("# mnote-web's server"):text.index("nginx:")]
    assert 'scopes: ["client"]' in example and "execute" not in example.split("scopes:")[1]


def test_check_config_prints_warnings_and_passes(tmp_path):
    cfg = base_config(tmp_path)
    cfg["security"]["api_keys"].append({"key": "old-key-0123456789", "expires_at": "2020-01-01T00:00:00Z"})
    cfg["hermes"]["model"]["api_key_env"] = "SURELY_UNSET_PROVIDER_KEY"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = run_main("--config", str(path), "check-config")
    assert res.returncode == 0, res.stderr
    assert f"warning: {path}:security.api_keys.1.expires_at:" in res.stderr
    assert f"warning: {path}:hermes.model.api_key_env: SURELY_UNSET_PROVIDER_KEY is not set" in res.stderr


def test_an_unset_key_variable_is_named_as_this_process_s_not_the_service_s(tmp_path):
    """check-config from another shell cannot see the running service's environment: the
    line says whose environment it read, and where the service's own state is."""
    cfg = base_config(tmp_path)
    cfg["hermes"]["model"]["api_key_env"] = "SURELY_UNSET_PROVIDER_KEY"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = run_main("--config", str(path), "check-config")
    [line] = [ln for ln in res.stderr.splitlines() if "SURELY_UNSET_PROVIDER_KEY" in ln]
    assert "service's environment" not in line
    assert "not set in the environment of this process" in line and "GET /health" in line


def test_check_config_without_make_points_at_the_development_key(tmp_path):
    """`make run` exports HERMES_SERVICE_API_KEY from data/dev-api-key; run without make,
    the refusal says so (and the Makefile and the hint name the same file)."""
    from hermes_service.config import DEV_KEY_ENV, DEV_KEY_FILE
    makefile = (ROOT / "Makefile").read_text()
    assert f"DEV_KEY ?= {DEV_KEY_FILE}\n" in makefile and f"${DEV_KEY_ENV}" in makefile
    res = run_main("--config", str(shipped_file("config.yaml", tmp_path / "config.yaml")),
                   "check-config", env={DEV_KEY_ENV: ""})
    assert res.returncode == 2
    [line] = [ln for ln in res.stderr.splitlines() if f"{DEV_KEY_ENV} is unset" in ln]
    assert DEV_KEY_FILE in line and f'export {DEV_KEY_ENV}="$(cat {DEV_KEY_FILE})"' in line


def test_service_refuses_to_start_on_what_check_config_reports(tmp_path):
    cfg = base_config(tmp_path)
    cfg["paths"]["users_template"] = str(tmp_path / "no-such-template")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check = run_main("--config", str(path), "check-config")
    serve = run_main("--config", str(path), "--port", "0")
    assert check.returncode == 2 and serve.returncode == 2
    lines = [line for line in check.stderr.splitlines() if not line.startswith("warning:")]
    assert lines and all(line.startswith(f"{path}:") for line in lines)
    assert any(line.startswith(f"{path}:paths.users_template:") for line in lines)
    assert all(line in serve.stderr.splitlines() for line in lines)
    assert not (tmp_path / "data" / "service-pids").exists()


def test_shipped_config_has_no_provider_until_one_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("HERMES_SERVICE_API_KEY", "x" * 32)
    monkeypatch.delenv("HERMES_PROVIDER_API_KEY", raising=False)
    cfg = load_config(shipped_file("config.yaml", tmp_path / "config.yaml"))
    issues = " ".join(cfg.provider_issues)
    assert "hermes.model.base_url and hermes.model.default" in issues
    assert "HERMES_PROVIDER_API_KEY" in issues


@pytest.mark.parametrize("service, ok", [
    ({"log_format": "json"}, True), ({"log_format": "text"}, True), ({"log_format": "xml"}, False),
    ({"node_id": "n1"}, True), ({"node_id": "eu-west_2"}, True), ({"node_id": None}, True),
    ({"node_id": "n.1"}, False), ({"node_id": "-n1"}, False), ({"node_id": "n" * 33}, False),
])
def test_log_format_and_node_id(tmp_path, service, ok):
    cfg = deep_merge(base_config(tmp_path), {"service": service})
    if ok:
        build_config(cfg)
    else:
        [problem] = problems(cfg)
        assert problem.startswith("c.yaml:service.")


# ---------------------------------------------------------------- every problem in one run
def wheres(lines: list[str]) -> list[str]:
    """The ``file:key`` of each ``file:key: problem`` line, sorted."""
    return sorted(line.split(": ")[0] for line in lines)


def test_schema_and_cross_field_problems_come_in_one_run():
    out = problems(deep_merge(base_config(ROOT), {
        "service": {"port": "80", "connection_limit": 100},
        "hermes": {"model": {"context_length": 16000}},
        "security": {"enable_ip_chek": True, "allowed_ips": ["10.0.0.1/8", 7],
                     "api_keys": [{"key": "short"}, {"key": " a-key-with-a-space-0123"}]}}))
    assert wheres(out) == [f"c.yaml:{k}" for k in sorted([
        "security",                       # schema: the unknown key...
        "security.allowed_ips.1",         # ... an address that is no string
        "security.api_keys.0.key",        # ... a key too short
        "service.port",                   # ... a port that is a string
        "security.allowed_ips.0",         # cross-field, on what validated: host bits,
        "security.api_keys.1.key",        # ... whitespace around a key,
        "service.connection_limit",       # ... too few connections for the threads,
        "hermes.model.context_length"])], out   # ... below Hermes's minimum
    assert any("10.0.0.0/8" in p for p in out)


def test_a_check_that_reads_a_refused_value_is_skipped():
    # threads is refused: "connection_limit 100 is too few for 32 threads" would judge a value
    # the file does not have (the default standing in for it)
    out = problems(deep_merge(base_config(ROOT), {"service": {"threads": "many",
                                                              "connection_limit": 100}}))
    assert wheres(out) == ["c.yaml:service.threads"], out
    out = problems(deep_merge(base_config(ROOT), {
        "mnote": {"models": [{"label": "no id"}], "default_model": "elsewhere"},
        "security": {"api_keys": "not a list"}}))
    assert wheres(out) == ["c.yaml:mnote.models.0.id", "c.yaml:security.api_keys"], out


def test_check_config_reports_the_file_and_what_it_names_in_one_run(tmp_path):
    cfg = base_config(tmp_path)
    cfg["service"]["port"] = 99999                                      # schema
    cfg["service"]["connection_limit"] = 10                             # cross-field
    cfg["paths"]["users_template"] = str(tmp_path / "no-such-template")  # what it names
    cfg["hermes"]["command"] = 5      # refused: its own check (is it on PATH?) is not run
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check = run_main("--config", str(path), "check-config")
    assert check.returncode == 2
    lines = [line for line in check.stderr.splitlines() if not line.startswith("warning:")]
    assert wheres(lines) == [f"{path}:{k}" for k in ("hermes.command", "paths.users_template",
                                                     "service.connection_limit", "service.port")]
    serve = run_main("--config", str(path), "--port", "0")           # the same, at once
    assert serve.returncode == 2 and all(line in serve.stderr.splitlines() for line in lines)

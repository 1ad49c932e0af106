"""``mnote.enabled: false`` removes the mnote extension (docs/mnote-client.md;
config.yaml ``mnote.enabled``): no mnote route (404) and none in ``/openapi.json``, no page
store, tool gateway or run manager, no retention step, the ``mnote`` commands refuse — and
the service starts and serves the v1 API. In process, the CLI runner stubbed at its seam."""
import yaml
from click.testing import CliRunner

from hermes_service.cli import cli
from hermes_service.config import ConfigError
from hermes_service.installed import build_config
from hermes_service.retention import collect
from hermes_service.web.openapi import build_document
from support.fixtures import API_KEY, base_config, deep_merge

H = {"X-API-Key": API_KEY}
OFF = {"mnote": {"enabled": False}}
MNOTE_PREFIXES = ("/api/hermes/", "/api/ai-agent/")


def test_the_extension_is_on_by_default(app_factory):
    app = app_factory()
    assert any(r.rule.startswith("/api/hermes/client/") for r in app.url_map.iter_rules())
    assert "mnote" in app.extensions["hermes_service"].extensions


def test_off_it_registers_no_route_builds_nothing_and_adds_no_step(app_factory, tmp_path):
    app = app_factory(OFF)
    rules = [r.rule for r in app.url_map.iter_rules()]
    assert not [r for r in rules if r.startswith(MNOTE_PREFIXES)]
    assert "/api/v1/sessions" in rules and "/health" in rules
    svc = app.extensions["hermes_service"]
    assert svc.extensions == {} and svc.retention_steps == [] and svc.drain_sources == []
    assert svc.reloaders == [] and "mnote" not in svc.processes.families
    assert not (tmp_path / "data" / "mnote.db").exists()          # no page store opened
    assert not (tmp_path / "data" / "run-events").exists()        # no run manager
    report = collect(svc, older_than=None, in_service=True)
    assert set(report.counts) == {"temp files", "session mappings", "transcripts",
                                  "owner links", "lock files", "idempotency keys",
                                  "lock-table entries", "home images"}


def test_off_the_document_has_no_mnote_route_tag_or_schema(app_factory):
    app = app_factory(OFF)
    doc = build_document(app, app.extensions["hermes_service"].config)
    assert app.test_client().get("/openapi.json", headers=H).json == doc
    assert doc["paths"] and not [p for p in doc["paths"] if p.startswith(MNOTE_PREFIXES)]
    # (the OpenAI-compatible routes are an extension of their own: openai.enabled)
    assert {t["name"] for t in doc["tags"]} - {"openai"} == {"v1", "health", "operations",
                                                            "docs"}
    schemas = doc["components"]["schemas"]
    assert "ClientError" not in schemas and not [n for n in schemas if n.startswith("Run")]
    # nor in its words: the description names only the v1 API, and no run-token scheme
    assert "mnote" not in doc["info"]["description"]
    assert list(doc["components"]["securitySchemes"]) == ["ApiKey"]


def test_off_the_service_serves_v1_and_answers_404_for_mnote(stubbed_app, stub):
    c = stubbed_app(OFF).test_client()
    assert c.get("/health").status_code == 200
    sid = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=H).json["session_id"]
    res = c.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hi"}, headers=H)
    assert res.status_code == 200 and res.json["response"] == "echo #1: hi"
    assert stub.calls[0]["run_binding"] is None
    for path in ("/api/hermes/client/tools", "/api/hermes/client/sessions"):
        res = c.get(path, headers={**H, "X-Mnote-Actor-Id": "alice"})
        assert res.status_code == 404 and res.json["code"] == "not_found"   # the v1 shape
    # the tool endpoint is an unknown path like any other: 404 with a key, 401 without one
    assert c.post("/api/hermes/tools/invoke", json={}, headers=H).status_code == 404
    assert c.post("/api/hermes/tools/invoke", json={}).status_code == 401


def test_off_the_start_line_names_only_the_v1_runner(make_config, tmp_path):
    from hermes_service.lifecycle import running
    from hermes_service.sandbox import Sandbox
    config = make_config(OFF)
    box = Sandbox(config.hermes.sandbox, config.data_dir, tmp_path)
    assert running(config, box).startswith("runner cli (openai acp), model ")
    assert running(make_config(), box).startswith("runner cli (panel cli) (openai acp), model ")


def test_the_key_is_a_boolean_fixed_for_the_process(tmp_path):
    try:
        build_config(deep_merge(base_config(tmp_path), {"mnote": {"enabled": "no"}}))
    except ConfigError as exc:
        assert any(p.startswith("<dict>:mnote.enabled:") for p in exc.problems), exc.problems
    else:
        raise AssertionError("mnote.enabled: 'no' was accepted")
    cfg = build_config(base_config(tmp_path))
    assert ("mnote", "enabled") in cfg.restart_only_keys


def test_off_its_section_is_still_validated_and_its_streams_still_counted(tmp_path):
    """Switched off, the ``mnote`` section is checked as when on (a typo is a problem either
    way: switching it back on must not reveal one) and ``mnote.max_event_streams`` still
    counts in the threads the service needs."""
    off = deep_merge(base_config(tmp_path), OFF)
    for bad, where in (({"default_model": "x"}, "<dict>:mnote.default_model: 'x' is not one of"),
                       ({"max_event_streams": 0}, "<dict>:mnote.max_event_streams: 0 is less"),
                       ({"unknwn": 1}, "<dict>:mnote: unknown key 'unknwn'")):
        try:
            build_config(deep_merge(off, {"mnote": bad}))
        except ConfigError as exc:
            assert any(p.startswith(where) for p in exc.problems), exc.problems
        else:
            raise AssertionError(f"mnote: {bad} was accepted while off")
    cfg = build_config(off)
    assert cfg.section("mnote").enabled is False
    streams = cfg.section("mnote").max_event_streams       # sized: at least 12
    assert streams == 12 and cfg.threads_needed == streams + 2 * 2 + 4 + 4


def test_off_the_mnote_commands_say_so(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(deep_merge(base_config(tmp_path), OFF)), "utf-8")
    res = CliRunner().invoke(cli, ["--config", str(path), "mnote", "add-workspace", "ws_1"])
    assert res.exit_code == 2
    assert f"{path}:mnote.enabled: false: the mnote extension is off" in res.output
    assert not (tmp_path / "data" / "mnote.db").exists()


def test_off_the_demo_refuses_to_start_and_seeds_nothing(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(deep_merge(base_config(tmp_path), OFF)), "utf-8")
    res = CliRunner().invoke(cli, ["--config", str(path), "--demo"])
    assert res.exit_code == 2, res.output
    assert "the extension offering the demo is switched off" in res.output
    assert not list((tmp_path / "data").rglob("mnote.db"))

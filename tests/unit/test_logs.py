"""Structured logs (docs/operations.md §Logs; ``service.log_format``).

In-process: the formatters and the context filter are the service's own (hermes_service.logs),
fed by the real request hooks, run workers and runner. The same lines from a real service
process (json format): test_deploy_nginx.py.
"""
import io
import json
import logging
import shutil
import threading
import time
from dataclasses import replace

import pytest

from hermes_service import logs
from hermes_service.runner import CliRunner, Processes
from support.fixtures import API_KEY

P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_1"}
FORGED = 'x\n2026-01-01 00:00:00,000 INFO hermes_service.access "forged" rid=FAKE\r\n{"level": "INFO"}'


@pytest.fixture(params=["json", "text"])
def captured(request, caplog):
    """Log records of this test as the service writes them (format = the param)."""
    caplog.set_level("INFO")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logs.json_formatter() if request.param == "json" else logs.TextFormatter())
    handler.addFilter(logs.ContextFilter())
    logging.getLogger().addHandler(handler)
    buf.format = request.param
    yield buf
    logging.getLogger().removeHandler(handler)


def lines(buf):
    text = buf.getvalue()
    assert text.endswith("\n")
    return text[:-1].split("\n")


def records(buf):
    return [json.loads(line) for line in lines(buf)]      # every line is one JSON object


def test_access_and_run_lines_carry_request_trace_and_run_ids(stubbed_app, stub, captured):
    app = stubbed_app()
    c = app.test_client()
    seen = threading.Event()
    # stands in for a line the runner logs inside the run's worker thread
    stub.block = lambda: (logging.getLogger("hermes_service.runner").info("probe from the run"),
                          seen.set())
    res = c.post(f"{P}/runs", headers={**A, "X-Request-Id": "req_fixed_1"}, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "s1", "message": "SECRET TEXT",
        "traceId": "trace_json_1"})
    run_id = res.json["runId"]
    assert seen.wait(10)
    run = app.extensions["hermes_service"].extensions["mnote"].runs.get(run_id, "user_1")
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    c.get("/api/v1/sessions/nope", headers={"X-API-Key": API_KEY})
    assert "SECRET TEXT" not in captured.getvalue()            # message text never at info
    if captured.format == "text":
        access, probe, other = (next(l for l in lines(captured) if m in l) for m in
                                ("POST /api/hermes/client/runs", "probe from the run", "nope"))
        assert f"rid=req_fixed_1 trace=trace_json_1 run={run_id} route=/api/hermes/client/runs " \
               f"status=200 ms=" in access
        assert f"rid=req_fixed_1 trace=trace_json_1 run={run_id} route=/api/hermes/client/runs" in probe
        assert " trace=- run=- route=/api/v1/sessions/<session_id> status=404 ms=" in other
        return
    recs = records(captured)
    access = next(r for r in recs if r["logger"] == "hermes_service.access"
                  and r["route"] == "/api/hermes/client/runs")
    assert access["request_id"] == "req_fixed_1" and access["trace_id"] == "trace_json_1"
    assert access["run_id"] == run_id and access["status"] == 200
    assert access["method"] == "POST" and access["client_ip"] == "127.0.0.1"
    assert isinstance(access["duration_ms"], float) and access["level"] == "INFO"
    assert access["time"].endswith("+00:00")
    probe = next(r for r in recs if r["message"] == "probe from the run")
    assert (probe["request_id"], probe["trace_id"], probe["run_id"], probe["route"]) == \
        ("req_fixed_1", "trace_json_1", run_id, "/api/hermes/client/runs")
    other = next(r for r in recs if r["logger"] == "hermes_service.access" and r["status"] == 404)
    assert other["route"] == "/api/v1/sessions/<session_id>" and other["trace_id"] is None
    assert other["run_id"] is None and other["request_id"].startswith("req_")


def test_a_message_with_newlines_and_quotes_cannot_forge_a_line(app_factory, captured):
    c = app_factory().test_client()
    forged_path = "/api/v1/sessions/" + FORGED.replace("\n", "%0a").replace("\r", "%0d") \
        .replace(" ", "%20").replace('"', "%22").replace("{", "%7b").replace("}", "%7d")
    c.get(forged_path, headers={"X-API-Key": API_KEY})
    c.post("/api/v1/sessions/s/messages", json={"message": FORGED}, headers={"X-API-Key": API_KEY})
    logging.getLogger("hermes_service").warning("value from outside: %s", FORGED)
    try:
        raise ValueError(FORGED)
    except ValueError:
        logging.getLogger("hermes_service").exception("failure")
    out = lines(captured)
    assert len(out) == 4                      # two access lines, the warning, the exception
    assert not any(l.startswith(("2026-01-01", '{"level"', "rid=")) for l in out)
    if captured.format == "json":
        recs = records(captured)
        assert [r["logger"] for r in recs] == ["hermes_service.access"] * 2 + ["hermes_service"] * 2
        assert recs[2]["message"] == "value from outside: " + FORGED     # intact, just escaped
        assert FORGED in recs[3]["exc_info"]
    else:
        assert "\\n2026-01-01" in out[2] and "\\r\\n{" in out[2]


def test_a_run_line_is_one_event_with_status_and_duration_but_no_message(captured, tmp_path,
                                                                        make_config):
    """The runner's real run line (a real process: ``true`` / ``false`` stand in for hermes)."""
    cfg = make_config({"hermes": {"command": shutil.which("true"), "timeout_seconds": 10,
                                  "stall_timeout_seconds": 10, "queue_wait_seconds": 1,
                                  "toolsets": [], "max_concurrent_runs": 1}}).hermes
    logs.start(request_id="req_run_1", route="/api/v1/sessions/<session_id>/messages")
    ctx = {"user": "u1", "session": "s1", "family": "v1"}
    from hermes_service.homes.users import UserHome
    home = UserHome("u1", tmp_path, tmp_path / ".hermes")
    CliRunner(Processes(cfg)).run_process(["chat", "--query=SECRET\nTEXT"], {}, home, None,
                                             None, ctx)
    CliRunner(Processes(replace(cfg, command=shutil.which("false")))).run_process(
        ["chat", "--query=SECRET"], {}, home, None, None, ctx)
    assert "SECRET" not in captured.getvalue()
    if captured.format == "text":
        ok, failed = (l for l in lines(captured) if "hermes chat" in l)
        assert "user=u1 session=s1 family=v1 rc=0" in ok and " status=ok ms=" in ok
        assert "rid=req_run_1 trace=- run=- route=/api/v1/sessions/<session_id>/messages" in ok
        assert " status=hermes_failed " in failed
        return
    ok, failed = (r for r in records(captured) if r["logger"] == "hermes_service.runner"
                  and r["message"].startswith("hermes chat"))
    assert (ok["status"], ok["request_id"], ok["runner"]) == ("ok", "req_run_1", "cli")
    assert ok["route"] == "/api/v1/sessions/<session_id>/messages" and ok["duration_ms"] >= 0
    assert failed["status"] == "hermes_failed"


def test_configure_installs_one_handler_in_the_chosen_format():
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    buf = io.StringIO()
    try:
        handler = logs.configure("warning", "json", stream=buf)
        assert root.handlers == [handler] and root.level == logging.WARNING
        logs.start(request_id="req_cfg")
        logging.getLogger("x").warning("hello")
        logging.getLogger("x").info("not at warning level")
        assert handler.flush()                  # the writer thread wrote what was queued
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        handler.close()
    [rec] = [json.loads(l) for l in buf.getvalue().splitlines()]
    assert rec["message"] == "hello" and rec["request_id"] == "req_cfg" and rec["run_id"] is None


def test_configure_stops_collecting_what_no_line_shows_and_the_lines_stay_the_same():
    """The caller's file/line/function, thread and process are not collected (the Logging
    HOWTO's "Optimization" switches); both formats print what they printed before."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    switches = (logging._srcfile, logging.logThreads, logging.logProcesses,
                logging.logMultiprocessing)
    out = {}
    try:
        for fmt in ("text", "json"):
            buf = io.StringIO()
            logging._srcfile = logging.__file__        # as before configure
            logging.logThreads = logging.logProcesses = logging.logMultiprocessing = True
            before = logs.json_formatter() if fmt == "json" else logs.TextFormatter()
            rec = logging.LogRecord("x", logging.INFO, __file__, 7, "hi %s", ("there",), None)
            rec.status = 200
            handler = logs.configure("info", fmt, stream=buf)
            assert logging._srcfile is None and not logging.logThreads
            assert not logging.logProcesses and not logging.logMultiprocessing
            logs.start(request_id="req_sw")
            logging.getLogger("x").info("hi %s", "there", extra={"status": 200})
            assert handler.flush()
            logs.ContextFilter().filter(rec)
            out[fmt] = buf.getvalue().splitlines(), before.format(rec)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        handler.close()
        (logging._srcfile, logging.logThreads, logging.logProcesses,
         logging.logMultiprocessing) = switches
    [text], want = out["text"]                      # (the time differs: left out)
    assert text.split(" ", 2)[2] == want.split(" ", 2)[2] and "rid=req_sw" in text
    [line], want = out["json"]
    assert {**json.loads(line), "time": ""} == {**json.loads(want), "time": ""}


def line_handler(stream, **kw) -> logs.LineHandler:
    logs.start()                                # no context fields of an earlier test
    handler = logs.LineHandler(stream, **kw)
    handler.setFormatter(logs.TextFormatter())
    handler.addFilter(logs.ContextFilter())
    return handler


def record(msg, *args, name="t") -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_the_writer_keeps_every_threads_lines_in_order_and_flush_waits_for_them():
    buf = io.StringIO()
    handler = line_handler(buf)
    args = [1]

    def log_from(i):
        for j in range(500):
            handler.handle(record("t%d %d", i, j))
    threads = [threading.Thread(target=log_from, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handler.handle(record("args as logged: %s", args))
    args.append(2)                              # formatted by the logging thread, not later
    assert handler.flush()
    out = buf.getvalue().splitlines()
    assert len(out) == 6 * 500 + 1 and out[-1].endswith("args as logged: [1]")
    for i in range(6):
        assert [int(l.rsplit(" ", 1)[1]) for l in out if f" t{i} " in l] == list(range(500))
    handler.close()
    assert not handler._thread.is_alive()       # closed: the writer thread ended


def test_configure_closes_the_handler_it_replaces_after_writing_what_it_held():
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        old = logs.configure("info", "text", stream=first)
        logs.start()
        logging.getLogger("x").info("to the first")
        new = logs.configure("info", "text", stream=second)
        assert first.getvalue().endswith(" INFO x to the first\n")       # written before close
        assert not old._thread.is_alive() and root.handlers == [new]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        new.close()


def test_the_exit_flush_writes_what_is_queued_though_it_holds_the_handlers_lock():
    """logging.shutdown (atexit) takes each handler's lock, then calls flush() and close():
    the writer must not need that lock to write."""
    stream = StuckStream()
    handler = line_handler(stream)
    handler.handle(record("first"))
    assert stream.writing.wait(10)              # "first" is being written; the rest queue
    for n in range(3):
        handler.handle(record("queued %d", n))
    stream.go.set()
    handler.acquire()                           # what logging.shutdown does, in this order
    try:
        assert handler.flush()
        handler.close()
    finally:
        handler.release()
    assert [l.rsplit(" ", 1)[-1] for l in stream.getvalue().splitlines()] == [
        "first", "0", "1", "2"]
    assert not handler._thread.is_alive()


class StuckStream(io.StringIO):
    """A stream whose writes wait until ``go`` is set (a log reader that stopped reading)."""

    def __init__(self):
        super().__init__()
        self.go, self.writing = threading.Event(), threading.Event()

    def write(self, text):
        self.writing.set()
        self.go.wait()
        return super().write(text)


def test_a_flood_on_a_stuck_stream_waits_once_then_drops_and_counts_and_says_so(monkeypatch):
    from prometheus_client import generate_latest

    from hermes_service import metrics
    monkeypatch.setattr(logs, "FULL_WAIT", 0.05)
    stream = StuckStream()
    handler = line_handler(stream, max_pending=3)
    before = logs.dropped_lines()
    handler.handle(record("first"))
    assert stream.writing.wait(10)              # the writer holds "first", stuck in write()
    for n in range(10):                         # 3 wait in the queue; the 4th waits FULL_WAIT
        handler.handle(record("flood %d", n))   # for room, then it and the rest are dropped
    assert logs.dropped_lines() - before == 7
    assert not handler.flush(timeout=0.05)      # nothing more was written: flush says so
    scraped = generate_latest(metrics.REGISTRY).decode()
    assert f"hermes_service_log_lines_dropped_total {float(logs.dropped_lines())}" in scraped
    stream.go.set()
    assert handler.flush()
    handler.handle(record("after"))             # the writer caught up: lines are kept again
    assert handler.flush()
    out = stream.getvalue().splitlines()
    assert [l.split(" ", 4)[-1] for l in out] == [
        "first", "log: 7 line(s) dropped: the log stream did not keep up (3 lines waiting; "
        "metric hermes_service_log_lines_dropped_total)", "flood 0", "flood 1", "flood 2",
        "after"]
    assert " WARNING hermes_service.logs " in out[1]
    handler.close()


def test_a_write_error_is_reported_like_a_stream_handler_and_the_writer_goes_on(monkeypatch):
    class Broken(io.StringIO):
        def write(self, text):
            if "boom" in text:
                raise OSError("disk full")
            return super().write(text)
    reported = []
    stream = Broken()
    handler = line_handler(stream)
    monkeypatch.setattr(handler, "handleError", reported.append)
    handler.handle(record("boom"))
    assert handler.flush()
    handler.handle(record("fine"))
    assert handler.flush()
    assert [r.getMessage() for r in reported] == ["boom"]
    assert stream.getvalue().endswith(" INFO t fine\n")
    handler.close()

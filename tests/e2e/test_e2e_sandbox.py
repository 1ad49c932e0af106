"""User ↔ user and agent ↔ service isolation, shown by attacks
(docs/sandbox.md): the real service, the real ``hermes`` CLI and ``hermes acp``, real bubblewrap, and
the scripted model driving Hermes's real terminal tool.

User A's agent runs one script through its terminal tool that tries everything a hostile
user would: read B's transcripts and home config, the service's config, data dir and
repository; list ``/proc`` and read other processes' ``environ``/``cmdline``; signal B's
Hermes process; write outside its home; find the provider key or the service's API key
anywhere it can look; call the service's API on loopback without a key. B's turn runs at
the same time (it waits in its own terminal tool until the test lets it finish) and must
complete unaffected.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from support.fixtures import API_KEY, ROOT, hermes_processes, wait_for

pytestmark = [pytest.mark.e2e,
              pytest.mark.sandbox]

TOOLS = ["terminal", "file", "code_execution"]


def terminal(command: str) -> str:
    """A message that makes the scripted model call Hermes's terminal tool once."""
    return "[[tools:terminal " + json.dumps({"command": command}) + "]]"


INSIDE_PORTS = (3128, 9401, 9402)      # the sandbox's own: sandbox_net.PORTS


def host_listening_ports() -> list[int]:
    """Every TCP port something listens on in this (the host's) network namespace."""
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def checks(answer: str) -> dict[str, str]:
    """``CHECK name=value`` lines printed by the attack script (JSON-escaped in the answer)."""
    text = answer.replace("\\n", "\n")
    pattern = r'CHECK (\w+)=([^\n\\"]*)'
    return {m.group(1): m.group(2).strip() for m in re.finditer(pattern, text)}


ATTACK = r"""
check() { echo "CHECK $1=$2"; }
K="sk-scr"; K="${K}ipted"            # the provider key (split: not in this script's text)
S="test-key-0123"; S="${S}456789abcdef"
check b_state "$(cat "$B/.hermes/state.db" 2>/dev/null | wc -c)"
check b_config "$(cat "$B/.hermes/config.yaml" 2>/dev/null | wc -c)"
check b_listed "$(ls -A "$B" 2>/dev/null | wc -l)"
check b_by_glob "$(ls -d /home/* 2>/dev/null | tr '\n' ' ')"
check svc_config "$(cat "$C" 2>/dev/null | wc -c)"
check data_dir "$(ls -A "$D" 2>/dev/null | wc -l)"
check repo "$(ls -A "$R" 2>/dev/null | grep -v '^\.hermes-venv$' | wc -l)"
check procs "$(ls /proc | grep -c '^[0-9]')"
check environ_key "$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep -c "$K")"
check environ_api_key "$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep -c "$S")"
cl="$(cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' '\n')"   # read before any grep of $D runs
check cmdline_data "$(printf '%s\n' "$cl" | grep -c -F "$D")"
check env_key "$(env | grep -c "$K")"
check files_key "$(grep -rIl -e "$K" -e "$S" /home /run /tmp /etc 2>/dev/null | wc -l)"
check home "$HOME $(pwd)"
check uid "$(id -u)"
check caps "$(grep CapEff /proc/self/status | tr -d ' \t' | cut -d: -f2)"
for f in /usr/pwned "$R/pwned" "$D/pwned" /pwned /etc/pwned; do touch "$f" 2>/dev/null; done
check tmp_free "$(df -k /tmp | tail -1 | tr -s ' ' | cut -d' ' -f2)"
check kill_b "$(python -c "
import os
try:
    os.kill($BPID, 9); print('killed')
except Exception as e:
    print(type(e).__name__)")"
check api "$(python -c "
import urllib.request as u
try:
    print(u.urlopen('$URL/api/v1/sessions/$BSID', timeout=10).status)
except Exception as e:
    print(getattr(e, 'code', type(e).__name__))")"
check inside_api "$(python -c "
import os, urllib.request as u
try:
    print(u.urlopen(os.environ['HERMES_SERVICE_URL'] + '/api/v1/sessions/$BSID', timeout=10).status)
except Exception as e:
    print(getattr(e, 'code', type(e).__name__))")"
cat > ports.py <<'PY'
import socket, sys
reached = []
for host in ('127.0.0.1', '127.0.0.2', '::1'):
    for port in map(int, sys.argv[1:]):
        s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET)
        s.settimeout(2)
        try:
            s.connect((host, port))
            reached.append(f'{host}:{port}')
        except OSError:
            pass
        s.close()
print(' '.join(reached) or 'none')
PY
check host_ports "$(python ports.py $HOST_PORTS)"
check abstract "$(python -c "
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect('\\0$ABSTRACT'); print('reached')
except OSError as e:
    print(type(e).__name__)")"
check listeners "$(grep -h ' 0A ' /proc/net/tcp /proc/net/tcp6 | awk '{print $2}' | sed 's/.*://' | sort | xargs)"
check internet "$(python -c "
import socket
try:
    socket.create_connection(('1.1.1.1', 443), timeout=3); print('reached')
except OSError as e:
    print(type(e).__name__)")"
check kernel_settings "$( (echo '|/home/hermes/x' > /proc/sys/kernel/core_pattern) 2>&1 | grep -c 'Read-only')"
check own_etc "$( { mkdir /etc/pwned-dir; touch /pwned-root; } 2>&1 | grep -c 'Read-only')"
check vsock "$(python -c "
import socket
try:
    socket.socket(40, socket.SOCK_STREAM); print('opened')
except OSError as e:
    print(e.errno)")"
check proxy "$(python -c "
import urllib.request as u
try:
    u.urlopen('http://example.com/', timeout=10); print('reached')
except Exception as e:
    print(getattr(e, 'code', type(e).__name__), getattr(e, 'headers', {}).get('X-Hermes-Egress-Refused'))")"
"""


@pytest.mark.parametrize("runner", ["cli", "acp"])
def test_one_users_agent_cannot_reach_another_user_or_the_service(start_service, tmp_path, runner):
    svc = start_service({"hermes": {"runner": runner, "toolsets": TOOLS,
                                    "sandbox": {"mode": "bwrap"}}})
    health = svc.get("/health")                             # sandboxed: nothing to warn about
    assert health.status_code == 200 and health.json()["status"] == "healthy", health.text
    users = tmp_path / "data" / "users"
    sid_a = svc.post("/api/v1/sessions", json={"user_id": "alice"}).json()["session_id"]
    sid_b = svc.post("/api/v1/sessions", json={"user_id": "bob"}).json()["session_id"]
    # B's first turn leaves a transcript with a secret in it
    first = svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": "bob-secret-7f3a"})
    assert first.status_code == 200, first.text
    bhome = users / "bob"
    assert b"bob-secret-7f3a" in (bhome / ".hermes" / "state.db").read_bytes() or \
        any(b"bob-secret-7f3a" in p.read_bytes() for p in (bhome / ".hermes").glob("state.db*"))

    # B's second turn waits in its own terminal tool until the test lets it finish
    marker = "bob-waits-" + str(time.monotonic_ns())
    go = bhome / "go"
    b_result = {}

    def bob():
        b_result["res"] = svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": terminal(
            f"echo {marker} >/dev/null; for i in $(seq 1200); do [ -e go ] && break; sleep 0.1; "
            "done; echo bob-finished")}, timeout=300)
    t = threading.Thread(target=bob)
    t.start()
    bpids = wait_for(lambda: hermes_processes(marker), "B's tool process", 120)

    # every port something listens on here (this service, the model pass-through, the scripted
    # model, …), one on 127.0.0.2 and an abstract Unix socket: none is reachable from inside
    extra = socket.create_server(("127.0.0.2", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0hermes-test-{time.monotonic_ns()}")
    abstract.listen(1)
    ports = sorted(set(host_listening_ports()) - set(INSIDE_PORTS))
    assert svc.port in ports and extra.getsockname()[1] in ports
    script = "\n".join([f"B='{bhome}'", f"D='{tmp_path / 'data'}'", f"R='{ROOT}'",
                        f"C='{svc.config_path}'", f"URL='{svc.url}'", f"BSID='{sid_b}'",
                        f"BPID={bpids[0]}", f"HOST_PORTS='{' '.join(map(str, ports))}'",
                        f"ABSTRACT='{abstract.getsockname()[1:].decode()}'", ATTACK])
    (users / "alice").mkdir(exist_ok=True)             # (made at its first turn)
    (users / "alice" / "attack.sh").write_text(script)
    res = svc.post(f"/api/v1/sessions/{sid_a}/messages", json={"message": terminal("sh attack.sh")})
    assert res.status_code == 200, res.text
    got = checks(res.json()["response"])
    extra.close()
    abstract.close()
    assert len(got) == 28, res.json()["response"]
    assert got["b_state"] == "0" and got["b_config"] == "0" and got["b_listed"] == "0", got
    assert got["b_by_glob"] == "/home/hermes", got          # one home, the same for every user
    assert got["svc_config"] == "0" and got["data_dir"] == "0" and got["repo"] == "0", got
    assert int(got["procs"]) < 10, got                      # its own processes only
    for key in ("environ_key", "environ_api_key", "cmdline_data", "env_key", "files_key"):
        assert got[key] == "0", (key, got)
    assert got["home"] == "/home/hermes /home/hermes", got
    assert got["uid"] != "0" and int(got["caps"], 16) == 0, got
    assert got["kill_b"] in ("ProcessLookupError", "PermissionError"), got
    # a network of its own: the host's loopback, this service's port, an abstract socket of
    # the host, the internet — none reachable; only its own three ports listen; this service
    # through its own port asks for a key like anyone; tools reach the internet only through
    # the egress proxy, which allows nothing by default
    assert got["api"] == "URLError" and got["host_ports"] == "none", got
    assert got["abstract"] == "ConnectionRefusedError", got
    assert got["listeners"] == "0C38 24B9 24BA", got       # 3128, 9401, 9402
    assert got["internet"] not in ("reached", ""), got
    assert got["proxy"] == "403 not_allowed", got
    assert got["inside_api"] == "403", got    # only the run-token routes (sandbox/net/service_gate.py)
    # the kernel's settings, its own root and /etc read-only; no socket to the hypervisor
    assert got["kernel_settings"] == "1" and got["own_etc"] == "2", got
    assert got["vsock"] == "97", got                        # EAFNOSUPPORT
    assert 0 < int(got["tmp_free"]) <= 256 * 1024, got      # a private, capped /tmp
    for f in (Path("/usr/pwned"), ROOT / "pwned", tmp_path / "data" / "pwned", Path("/pwned"),
              Path("/etc/pwned")):
        assert not f.exists(), f
    assert API_KEY not in res.text and "sk-scripted" not in res.text
    assert str(tmp_path) not in res.json()["response"]      # no host layout in the answer

    # B was neither read nor stopped: it finishes when let go
    go.write_text("")
    t.join(300)
    assert b_result["res"].status_code == 200, b_result["res"].text
    assert "bob-finished" in b_result["res"].json()["response"]
    assert svc.get("/health").status_code == 200


LIMITS = {"memory_mb": 768, "processes": 160, "cpu_seconds": 10, "file_size_mb": 8,
          "open_files": 256, "tmp_mb": 16}

#: one attack per limit: (a script put in the home, the terminal command, what
#: run_limit_exceeded must name). Scripts, not ``python -c``: Hermes asks approval for that.
LIMIT_ATTACKS = {
    "processes": ("import os, time\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        time.sleep(0.01)\n", "python greedy.py",
                  "processes"),
    "memory": ("x = []\nwhile True:\n    x.append(bytearray(64 * 1024 * 1024))\n",
               "python greedy.py", "memory"),
    "cpu": ("while True:\n    pass\n", "python greedy.py", "CPU time"),
    "file_size": ("", "head -c 40000000 /dev/zero > big.bin; echo wrote", "file size"),
}


def sandbox_processes(data_dir: Path) -> list[int]:
    """Live processes in a sandbox of one of this service's users (whose ``/home/hermes``
    is a home under ``data_dir``; they show no host path themselves)."""
    return [pid for home in (data_dir / "users").iterdir() for pid in hermes_processes(str(home))]


@pytest.mark.parametrize("runner", ["cli", "acp"])
def test_limits_end_the_turn_with_their_code_and_others_carry_on(start_service, tmp_path, runner):
    svc = start_service({"hermes": {"runner": runner, "toolsets": TOOLS,
                                    "sandbox": {"mode": "bwrap", "limits": LIMITS}}})
    for name, (script, command, says) in LIMIT_ATTACKS.items():
        if runner == "acp" and name in ("memory", "file_size"):
            continue          # the same sandbox and rules as the CLI; kept short on ACP
        sid = svc.post("/api/v1/sessions", json={"user_id": f"greedy-{name}"}).json()["session_id"]
        home = tmp_path / "data" / "users" / f"greedy-{name}"
        home.mkdir(parents=True)                # (made with its files at the first turn)
        (home / "greedy.py").write_text(script)
        res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal(command)})
        assert res.status_code == 422, (name, res.json().get("response", res.text)[-600:])
        body = res.json()
        assert body["code"] == "run_limit_exceeded" and says in body["detail"], (name, body)
        # the next turn of this session works; another user is served at once: the next
        # attack's user (its turn runs until its own limit), after the last a calm one
        again = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "after the limit"})
        assert again.status_code == 200, (name, again.text)
    other = svc.post("/api/v1/sessions", json={"user_id": "calm"}).json()["session_id"]
    ok = svc.post(f"/api/v1/sessions/{other}/messages", json={"message": "still here"})
    assert ok.status_code == 200, ok.text
    if runner == "cli":       # nothing of the limited turns is left running; the file capped
        wait_for(lambda: not sandbox_processes(tmp_path / "data"), "no sandbox left", 30)
        big = tmp_path / "data" / "users" / "greedy-file_size" / "big.bin"
        assert big.stat().st_size <= LIMITS["file_size_mb"] * 1024 * 1024


def test_a_home_over_its_quota_fails_before_hermes_starts(start_service, tmp_path, model):
    svc = start_service({"hermes": {"sandbox": {"mode": "bwrap", "max_home_mb": 30}}})
    sid = svc.post("/api/v1/sessions", json={"user_id": "hoarder"}).json()["session_id"]
    first = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "small"})
    assert first.status_code == 200, first.text
    with open(tmp_path / "data" / "users" / "hoarder" / "hoard.bin", "wb") as f:
        f.write(b"\1" * 40 * 1024 * 1024)
    seen = len(model.main_requests())
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "one more"})
    assert res.status_code == 507, res.text
    assert res.json()["code"] == "home_quota_exceeded" and "max_home_mb" in res.json()["detail"]
    assert len(model.main_requests()) == seen             # Hermes never started
    (tmp_path / "data" / "users" / "hoarder" / "hoard.bin").unlink()
    assert svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "ok"}).status_code == 200


def test_nothing_a_warm_turn_started_outlives_it(start_service, tmp_path):
    """A tool command that daemonizes (setsid, background) is ended when the ACP turn ends,
    so it cannot burn CPU or hold files between turns, outside every turn's limits. Orphans
    that ended stay zombies under Hermes (PID 1, which never reaps them), each holding a place
    of ``limits.processes``: past a quarter of it the process is retired and replaced."""
    svc = start_service({"hermes": {"runner": "acp", "toolsets": TOOLS,
                                    "sandbox": {"mode": "bwrap", "limits": {"processes": 64}}}})
    sid = svc.post("/api/v1/sessions", json={"user_id": "daemon"}).json()["session_id"]
    (tmp_path / "data" / "users" / "daemon").mkdir(parents=True)    # (the first turn's)
    (tmp_path / "data" / "users" / "daemon" / "d.sh").write_text(
        "setsid sh -c 'while :; do sleep 0.37; done' </dev/null >/dev/null 2>&1 &\n"
        "for i in $(seq 20); do (sleep 0.01 &); done; sleep 0.2\necho started\n")
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal("sh d.sh")})
    assert res.status_code == 200 and "started" in res.text, res.text

    def looping():
        found = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and b"sleep 0.37" in (d / "cmdline").read_bytes():
                    found.append(d.name)
            except OSError:
                pass
        return found
    wait_for(lambda: not looping(), "the daemonized loop to be ended", 30)
    svc.wait_log("left in its sandbox")
    svc.wait_log("ended processes it does not reap")      # 21 zombies >= 64 // 4
    again = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "still warm"})
    assert again.status_code == 200, again.text


def test_an_env_file_planted_in_the_home_cannot_turn_approvals_off(start_service, tmp_path):
    """Hermes loads ``$HERMES_HOME/.env`` over its environment; ``HERMES_YOLO_MODE=1`` there
    would run dangerous commands unasked. Inside the sandbox it reads empty."""
    svc = start_service({"hermes": {"toolsets": ["terminal"], "sandbox": {"mode": "bwrap"}}})
    sid = svc.post("/api/v1/sessions", json={"user_id": "yolo"}).json()["session_id"]
    home = tmp_path / "data" / "users" / "yolo"
    (home / ".hermes").mkdir(parents=True)      # (the home is made at the first turn)
    (home / ".hermes" / ".env").write_text("HERMES_YOLO_MODE=1\n")
    (home / "scratch").mkdir()
    (home / "scratch" / "keep.txt").write_text("still here")
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal("rm -r ./scratch")})
    assert res.status_code == 200, res.text
    assert (home / "scratch" / "keep.txt").read_text() == "still here", res.text

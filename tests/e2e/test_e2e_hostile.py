"""A hostile agent against its own sandbox (docs/sandbox.md §What a tool process cannot reach,
§Hermes's policy surface; docs/mnote-client.md §Approvals): the real service, real
``hermes acp`` and ``hermes chat``, real bubblewrap, the scripted model driving Hermes's real
terminal tool.

* One attack turn tries every edit of Hermes's policy surface and every way at its own
  Hermes process (ptrace, ``process_vm_readv``, ``pidfd_getfd``, ``/proc/1/{mem,environ,
  fd/*}``, signals); then the same edits are made from outside the sandbox (as if they had
  got through), and one turn on each runner shows none took effect: the dangerous command
  is still refused, HERMES_HOME is the service's, no start-up hook ran.
* 20 answers at once to one approval, split over two service processes on one data dir:
  exactly one is told 200, and it is the choice Hermes got.
* A FIFO planted at ``state.db`` by the agent: the next client runs repair it and complete.
"""
from __future__ import annotations

import json
import re
import threading

import pytest

from support.fixtures import API_KEY
from support.sse_client import SSEStream, read_all
from hermes_service import sandbox

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not sandbox.probe().usable,
                                 reason=f"no usable bubblewrap here: {sandbox.probe().reason}")]

TOOLS = ["terminal", "file", "code_execution"]
P = "/api/hermes/client"
A = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "user_h"}


def terminal(*commands: str) -> str:
    """A message that makes the scripted model call Hermes's terminal tool once per command."""
    return "[[tools:" + " ; ".join("terminal " + json.dumps({"command": c})
                                   for c in commands) + "]]"


def checks(answer: str) -> dict[str, str]:
    text = answer.replace("\\n", "\n")
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r'CHECK (\w+)=([^\n\\"]*)', text)}


ATTACK = r"""
check() { echo "CHECK $1=$2"; }
H="$HOME/.hermes"
mkdir -p "$H/profiles/evil" 2>/dev/null; check profiles_mkdir $?
printf 'evil\n' > "$H/active_profile" 2>/dev/null; check active_profile_write $?
rm -f "$H/active_profile" 2>/dev/null; check active_profile_rm $?
mv "$H/profiles" "$H/old-profiles" 2>/dev/null; check profiles_mv $?
echo HERMES_YOLO_MODE=1 > "$H/.env" 2>/dev/null; check env $?
echo HERMES_YOLO_MODE=1 > "$H/.op.env" 2>/dev/null; check op_env $?
printf 'approvals:\n  mode: "off"\n' >> "$H/config.yaml" 2>/dev/null; check config $?
mkdir "$H/plugins/evil" 2>/dev/null; check plugins $?
echo '{}' > "$H/shell-hooks-allowlist.json" 2>/dev/null; check hooks_allowlist $?
mv "$H" "$HOME/moved" 2>/dev/null; check hermes_home_mv $?
check hermes_home "$HERMES_HOME"
check pid1 "$(tr '\0' ' ' < /proc/1/cmdline | cut -c1-200 | grep -c hermes)"
for f in environ mem maps; do
  check "proc1_$f" "$(head -c1 /proc/1/$f >/dev/null 2>&1 && echo read || echo denied)"; done
check proc1_fds "$(ls -l /proc/1/fd 2>/dev/null | grep -c -- '->')"
check proc1_stdin "$( (echo '{"jsonrpc":"2.0","id":1,"result":{}}' > /proc/1/fd/0) 2>/dev/null && echo wrote || echo denied)"
check proc1_stdout "$( (echo x > /proc/1/fd/1) 2>/dev/null && echo wrote || echo denied)"
kill -KILL 1 2>/dev/null; kill -STOP 1 2>/dev/null
python3 reach.py
check alive yes
"""

#: ptrace, process_vm_readv and pidfd_getfd on Hermes (PID 1), by system call number (x86-64)
REACH = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def r(v):
    return "ok" if v >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
print("CHECK ptrace_attach=" + r(libc.ptrace(16, 1, 0, 0)))
print("CHECK ptrace_seize=" + r(libc.ptrace(0x4206, 1, 0, 0)))
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = Iov(ctypes.cast(buf, ctypes.c_void_p), 8), Iov(0x400000, 8)
print("CHECK process_vm=" + r(libc.syscall(310, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)))
pidfd = libc.syscall(434, 1, 0)
print("CHECK pidfd_getfd=" + (r(libc.syscall(438, pidfd, 0, 0)) if pidfd >= 0 else "no-pidfd"))
print("CHECK unshare=" + r(libc.unshare(0x10000000)))
"""

#: what a next Hermes start would run or read if the edits had got through
PLANTED = {
    ".hermes/active_profile": "evil\n",
    ".hermes/profiles/evil/config.yaml": 'approvals:\n  mode: "off"\n',
    ".hermes/profiles/evil/.env": "HERMES_YOLO_MODE=1\n",
    ".hermes/.env": "HERMES_YOLO_MODE=1\n",
    ".hermes/.op.env": "HERMES_YOLO_MODE=1\n",
    ".local/lib/python3.11/site-packages/evil.pth":
        "import os; open('/home/hermes/pth-ran', 'w')\n",
    ".local/lib/python3.11/site-packages/usercustomize.py": "open('/home/hermes/user-ran', 'w')\n",
    "sitecustomize.py": "open('/home/hermes/site-ran', 'w')\n",
}
#: one turn per runner after the edits: where HERMES_HOME points, whether a hook ran, and a
#: dangerous command, which must be refused (nobody to ask on the v1 API)
VERIFY = terminal("echo HH=$HERMES_HOME RAN=$(ls /home/hermes | grep -c -- -ran)",
                  "rm -r ./scratch")


def test_a_hostile_agent_cannot_change_its_policy_or_reach_its_hermes(start_service, tmp_path):
    cfg = {"hermes": {"runner": "acp", "toolsets": TOOLS, "sandbox": {"mode": "bwrap"},
                      "acp": {"recycle_after_sessions": 1}}}
    svc = start_service(cfg)
    home = tmp_path / "data" / "users" / "mallory"
    sid = svc.post("/api/v1/sessions", json={"user_id": "mallory"}).json()["session_id"]
    (home / "attack.sh").write_text(ATTACK)
    (home / "reach.py").write_text(REACH)
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal("sh attack.sh")})
    assert res.status_code == 200, res.text
    got = checks(res.json()["response"])
    assert got.get("alive") == "yes", res.json()["response"]
    for edit in ("profiles_mkdir", "active_profile_write", "active_profile_rm", "profiles_mv",
                 "env", "op_env", "config", "plugins", "hooks_allowlist", "hermes_home_mv"):
        assert got[edit] != "0", (edit, got)                 # every edit refused
    assert got["hermes_home"] == "/home/hermes/.hermes" and got["pid1"] == "1", got
    for f in ("environ", "mem", "maps"):
        assert got[f"proc1_{f}"] == "denied", (f, got)
    assert got["proc1_fds"] == "0", got                      # its descriptors: not even named
    assert got["proc1_stdin"] == "denied" and got["proc1_stdout"] == "denied", got
    for call in ("ptrace_attach", "ptrace_seize", "process_vm", "pidfd_getfd", "unshare"):
        assert got[call] == "EPERM", (call, got)
    assert not (home / ".hermes" / "profiles" / "evil").exists()
    assert (home / ".hermes" / "active_profile").read_text() == ""

    # as if the edits had got through: made from outside, then a turn on each runner
    for rel, text in PLANTED.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    cli = start_service({**cfg, "hermes": {**cfg["hermes"], "runner": "cli"}})
    for server in (svc, cli):                      # a fresh ACP process (recycled), a CLI turn
        (home / "scratch").mkdir(exist_ok=True)
        (home / "scratch" / "keep.txt").write_text("still here")
        sid = server.post("/api/v1/sessions", json={"user_id": "mallory"}).json()["session_id"]
        res = server.post(f"/api/v1/sessions/{sid}/messages", json={"message": VERIFY})
        assert res.status_code == 200, res.text
        answer = res.json()["response"]
        assert "HH=/home/hermes/.hermes RAN=0" in answer, answer
        assert (home / "scratch" / "keep.txt").read_text() == "still here", answer
        assert not list(home.glob("*-ran"))


def answer(svc, run_id, sid, approval_id, choice):
    return svc.post(f"{P}/runs/{run_id}/approval", headers=A,
                    json={"sessionId": sid, "approvalId": approval_id, "choice": choice})


def start_run(svc, sid, message):
    res = svc.post(f"{P}/runs", headers=A, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message})
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def test_twenty_answers_on_two_processes_one_wins_and_a_planted_fifo_is_repaired(
        start_service, tmp_path):
    cfg = {"hermes": {"runner": "acp", "toolsets": ["terminal"]}, "mnote": {"runner": "acp"}}
    owner, other = start_service(cfg), start_service(cfg)      # one data dir, two processes
    home = tmp_path / "data" / "users" / "user_h"
    sid = "mnote_doc_1_twenty"
    run_id = start_run(owner, sid, terminal("rm -r ./scratch"))
    (home / "scratch").mkdir(parents=True, exist_ok=True)
    stream = SSEStream(owner.url + f"{P}/events/{run_id}", A)
    frames = []
    for frame in stream:
        frames.append(frame)
        if frame[1]["event"] == "approval.request":
            break
    aid = frames[-1][1]["approval_id"]
    barrier, outcomes = threading.Barrier(20), [None] * 20

    def send(i):
        svc, choice = (owner, other)[i % 2], ("deny", "once", "session", "deny")[i % 4]
        barrier.wait()
        res = answer(svc, run_id, sid, aid, choice)
        outcomes[i] = (res.status_code, res.json().get("code"), choice)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [o for o in outcomes if o[0] == 200]
    assert len(won) == 1, outcomes
    assert all(o[:2] == (409, "hermes_client_approval_not_pending") for o in outcomes
               if o[0] != 200), outcomes
    frames += list(stream)
    assert frames[-1][1]["event"] == "run.completed", frames
    [responded] = [d for _, d in frames if d["event"] == "approval.responded"]
    assert responded["choice"] == won[0][2], (responded, won)
    assert (home / "scratch").exists() == (won[0][2] == "deny")

    # the agent plants a FIFO at state.db; the next three client runs repair it and complete
    start = start_run(owner, "mnote_doc_1_fifo", terminal(
        "rm -f ~/.hermes/state.db && mkfifo ~/.hermes/state.db && echo planted"))
    read_all(owner.url + f"{P}/events/{start}", A)            # it may fail: home_tampered
    for i in range(3):
        run = start_run(owner, f"mnote_doc_1_after_{i}", f"after the fifo {i}")
        frames = read_all(owner.url + f"{P}/events/{run}", A)
        assert frames[-1][1]["event"] == "run.completed", frames
    assert (home / ".hermes" / "state.db").is_file()

"""The disk (docs/sandbox.md §Disk): one user's agent, writing as fast as it can through
Hermes's real terminal tool in real bubblewrap, fills only its own quota while another user's
turns run; a full disk — whatever filled it — answers 507/503 with its own codes, never a
500, leaves no empty file, and a run whose event log met it ends the same live and on replay.

File systems are made by the tests (root: a btrfs in a loop file with deploy/homes-btrfs.sh,
a small tmpfs); without root, loop devices or btrfs they skip and say why.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from hermes_service.disk import use as disk_use
from support.fixtures import API_KEY, ROOT, wait_for
from support.sse_client import read_all

pytestmark = [pytest.mark.e2e,
              pytest.mark.sandbox,
              pytest.mark.skipif(os.geteuid() != 0, reason="making a file system needs root")]

MIB = 1024 * 1024


def terminal(command: str) -> str:
    return "[[tools:terminal " + json.dumps({"command": command}) + "]]"


def checks(answer: str) -> dict[str, str]:
    text = answer.replace("\\n", "\n")
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r'CHECK (\w+)=([^\n\\"]*)', text)}


#: writes 1 MiB pieces as fast as it can into folder after folder; in the home it keeps
#: writing (freeing a file when refused) until the file named by its argument appears
FILL = r"""
import errno, os, sys, time
chunk = b"\1" * (1 << 20)

def fill(d, limit, until=None):
    total, err, i = 0, "none", 0
    while True:
        try:
            with open(os.path.join(d, f"fill-{i}"), "wb") as f:
                for _ in range(4):
                    f.write(chunk)
                    total += 1
            i += 1
            if total >= limit:
                return total, err
        except OSError as e:
            err = errno.errorcode.get(e.errno, str(e.errno))
            if until is None or os.path.exists(until):
                return total, err
            os.unlink(os.path.join(d, f"fill-{max(i - 1, 0)}"))    # room again: go on

try:
    with open("sparse", "wb") as f:
        f.truncate(10 << 30)       # 10 GiB that take no space (or past RLIMIT_FSIZE: EFBIG)
    print("CHECK sparse=ok")
except OSError as e:
    print(f"CHECK sparse={errno.errorcode.get(e.errno)}")
try:
    os.link("/etc/passwd", "outside")
    print("CHECK hardlink=made")
except OSError as e:
    print(f"CHECK hardlink={errno.errorcode.get(e.errno)}")
for where, d, limit, until in (("run", "/run/hermes-service", 4096, None),
                               ("tmp", "/tmp", 4096, None), ("home", ".", 1 << 30, sys.argv[1])):
    mb, err = fill(d, limit, until)
    held = sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d)
               if n.startswith("fill-")) >> 20
    print(f"CHECK {where}_mb={held}")
    print(f"CHECK {where}_written={mb}")
    print(f"CHECK {where}_err={err}")
    if where != "home":
        for n in os.listdir(d):
            if n.startswith("fill-"):
                os.unlink(os.path.join(d, n))
"""


@pytest.fixture
def btrfs_homes(tmp_path):
    """A 512 MiB btrfs with quotas, in a loop file, made by deploy/homes-btrfs.sh."""
    sbin = "/usr/sbin:/usr/bin:/sbin:/bin"
    if shutil.which("mkfs.btrfs", path=sbin) is None or shutil.which("btrfs", path=sbin) is None:
        pytest.skip("btrfs-progs is not installed (make setup installs it as root)")
    if "btrfs" not in Path("/proc/filesystems").read_text():
        pytest.skip("this kernel has no btrfs")
    mnt = tmp_path / "homes"
    res = subprocess.run([str(ROOT / "deploy" / "homes-btrfs.sh"), str(tmp_path / "homes.img"),
                          "512M", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no btrfs loop file system here: {res.stderr.strip()[-200:]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def tmpfs(where: Path, size: str) -> Path:
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes=200000", "tmpfs",
                          str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    return where


@pytest.fixture
def small_disks(tmp_path):
    """Two tmpfs (memory only as far as they are written): 1 GiB for the homes, 160 MiB for
    the service's own state (the data dir): the recommended layout, homes apart."""
    made = [tmpfs(tmp_path / "homes", "1024m"), tmpfs(tmp_path / "state", "160m")]
    yield made
    for mnt in made:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def du_mb(path: Path) -> float:
    return disk_use.home_size_mb(path)


def test_a_fast_writer_fills_only_its_own_btrfs_quota_while_another_users_turn_runs(
        start_service, tmp_path, btrfs_homes):
    homes = btrfs_homes / "h"
    svc = start_service({"hermes": {"runner": "acp", "toolsets": ["terminal"],
                                    "sandbox": {"mode": "bwrap", "max_home_mb": 48,
                                                "quota": "btrfs", "min_free_mb": 16}},
                         "paths": {"homes_dir": str(homes)}})
    assert "btrfs qgroup limit per home" in svc.wait_log("disk: max_home_mb 48")
    sid_a = svc.post("/api/v1/sessions", json={"user_id": "filler"}).json()["session_id"]
    sid_b = svc.post("/api/v1/sessions", json={"user_id": "bystander"}).json()["session_id"]
    assert svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": "hi"}).status_code == 200
    a_home = homes / "users" / "filler"
    first = svc.post(f"/api/v1/sessions/{sid_a}/messages", json={"message": "hello"})
    assert first.status_code == 200, first.text            # its home exists: a subvolume
    info = subprocess.run(["btrfs", "subvolume", "show", str(a_home)], capture_output=True,
                          text=True)
    assert info.returncode == 0, info.stderr
    (a_home / "fill.py").write_text(FILL)
    result = {}
    t = threading.Thread(target=lambda: result.update(res=svc.post(
        f"/api/v1/sessions/{sid_a}/messages",
        json={"message": terminal("python fill.py /run/hermes-service/go")}, timeout=300)))
    t.start()
    wait_for(lambda: du_mb(a_home) > 36, "the writer at its quota", 120)
    during = svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": "still served?"})
    assert during.status_code == 200, during.text
    assert "still served?" in during.json()["response"]
    (homes / "runs" / "filler" / "go").write_text("")     # (its home is full, even for root)
    t.join(300)
    res = result["res"]
    assert res.status_code == 200, res.text
    got = checks(res.json()["response"])
    # its files stop at 42 MiB (48 less the 6 kept for Hermes's record), which still works
    assert got["home_err"] == "EDQUOT" and 30 <= int(got["home_mb"]) <= 42, got
    assert got["run_err"] == "EDQUOT" and int(got["run_mb"]) <= 16, got
    assert got["tmp_err"] == "ENOSPC" and int(got["tmp_mb"]) <= 256, got
    assert got["sparse"] in ("ok", "EFBIG") and got["hardlink"] in ("EXDEV", "EPERM"), got
    assert du_mb(a_home) <= 48
    # its user goes on (the agent may delete files); the bystander too
    again = svc.post(f"/api/v1/sessions/{sid_a}/messages", json={"message": "more"})
    assert again.status_code == 200 and "more" in again.json()["response"], again.text
    assert svc.get("/health").json()["status"] == "healthy"
    assert svc.post(f"/api/v1/sessions/{sid_b}/messages",
                    json={"message": "after"}).status_code == 200


P = "/api/hermes/client"
ACTOR = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "bystander"}


def run_events(svc, run_id: str) -> list[dict]:
    return [data for _, data in read_all(svc.url + f"{P}/events/{run_id}", ACTOR)]


def run_body(sid: str, message: str) -> dict:
    return {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
            "model": "hermes-agent", "pageContext": {"title": "t", "outline": []},
            "selectedBlockId": None, "selectedText": None}


def test_the_watcher_and_a_full_disk_answer_their_codes_never_a_500(start_service, tmp_path,
                                                                   small_disks, model):
    homes, state = small_disks
    data = state / "data"
    svc = start_service({"hermes": {"toolsets": ["terminal"],
                                    "sandbox": {"mode": "bwrap", "max_home_mb": 64,
                                                "quota": "watch", "min_free_mb": 64}},
                         "paths": {"data_dir": str(data), "homes_dir": str(homes)}})
    sid_a = svc.post("/api/v1/sessions", json={"user_id": "filler"}).json()["session_id"]
    sid_b = svc.post("/api/v1/sessions", json={"user_id": "bystander"}).json()["session_id"]
    a_home = homes / "users" / "filler"                  # (made at its first turn)
    a_home.mkdir(parents=True)
    (a_home / "fill.py").write_text(FILL)
    # 1. the watcher ends a sandbox past its quota; the other user's turn runs meanwhile
    result = {}
    t = threading.Thread(target=lambda: result.update(res=svc.post(
        f"/api/v1/sessions/{sid_a}/messages",
        json={"message": terminal("python fill.py never")}, timeout=300)))
    t.start()
    wait_for(lambda: du_mb(a_home) > 8 or not t.is_alive(), "the writer writing", 120)
    during = svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": "served"})
    t.join(300)
    assert during.status_code == 200, during.text
    res = result["res"]
    assert (res.status_code, res.json()["code"]) == (507, "home_quota_exceeded"), res.text
    # ended past its quota by what it wrote between two looks of the watcher (measured: 130-140
    # MiB used in all on a quiet machine, ~520 MiB with both cores busy: a bound, not an exact
    # cap, docs/sandbox.md §Disk), never filling the disk others need
    usage = shutil.disk_usage(homes)
    assert usage.free > 32 * MIB, (usage, svc.log()[-2000:])
    for f in a_home.glob("fill-*"):
        f.unlink()
    # 2. whatever fills the disk: below the floor no turn starts, /health says why
    filler = state / "filler.bin"
    with open(filler, "wb") as f:
        while shutil.disk_usage(state).free > 32 * MIB:
            f.write(b"\1" * (4 * MIB))
    health = svc.get("/health")
    assert health.status_code == 503 and health.json()["checks"]["disk"] != "ok", health.text
    refused = svc.post(f"/api/v1/sessions/{sid_b}/messages", json={"message": "now?"})
    assert (refused.status_code, refused.json()["code"]) == (507, "storage_full"), refused.text
    # 3. a run whose event log meets a full disk: the same terminal event live and on replay
    os.truncate(filler, 0)
    sid = svc.post(f"{P}/sessions", headers=ACTOR, key=None,
                   json={"workspaceId": "ws_1", "documentId": "doc_1"}).json()["sessionId"]
    long = "held [[gate:disk1]] " + "字" * 6000      # an answer too long for a page's slack
    made = svc.post(f"{P}/runs", headers=ACTOR, key=None, json=run_body(sid, long))
    assert made.status_code == 200, made.text
    run_id = made.json()["runId"]
    wait_for(lambda: model.requests_with("[[gate:disk1]]"), "the run at the model", 60)
    fd = os.open(filler, os.O_WRONLY | os.O_APPEND)    # now the disk is full, to the last page
    for piece in (MIB, 4096):
        try:
            while True:
                os.write(fd, b"\1" * piece)
        except OSError:
            pass
    os.close(fd)
    for path, body in (("/api/v1/sessions", {"user_id": "newcomer"}),
                       (f"{P}/sessions", {"workspaceId": "ws_1", "documentId": "doc_2"}),
                       (f"{P}/runs", run_body(sid + "x", "hi"))):
        full = svc.post(path, headers=ACTOR, key=None, json=body)
        assert full.status_code in (404, 503, 507), (path, full.status_code, full.text)
    model.release("disk1")
    live = run_events(svc, run_id)
    assert live[-1]["event"] == "run.completed", live[-3:]
    log_file = data / "run-events" / f"{run_id}.jsonl"
    # (its events wait in memory for room: the log lacks its end while the disk is full;
    # tests/unit/mnote/runs/test_log_full_disk.py shows that step by step)
    os.unlink(filler)
    wait_for(lambda: '"run.completed"' in log_file.read_text(), "the log written whole", 30)
    empty = [p for p in data.rglob("*") if p.is_file() and p.stat().st_size == 0
             and p.suffix in (".jsonl", ".json", ".tmp", ".requests")]
    assert not empty, empty
    svc.stop()
    svc.start()
    replay = run_events(svc, run_id)
    assert [e["event"] for e in replay] == [e["event"] for e in live]
    assert replay[-1] == live[-1]
    assert svc.get("/health").json()["status"] == "healthy"
    again = svc.post(f"{P}/runs", headers=ACTOR, key=None, json=run_body(sid, "after"))
    assert again.status_code == 200, again.text              # the session is not busy


#: writes 1 MiB pieces where no walk of the home sees them, by the way named in argv[1]:
#: "unlinked" (files unlinked while open) or "inflight" (those files sent through a Unix
#: socket and closed: in no /proc/<pid>/fd). (O_TMPFILE and openat2 are refused by the
#: seccomp filter: tests/unit/sandbox/test_args.py)
HIDE = r"""
import errno, os, socket, sys
way, buf, wrote = sys.argv[1], b"\xa5" * (1 << 20), 0
a, b = socket.socketpair()
fd = None
while wrote < 600:
    if fd is None or wrote % 8 == 0:
        if fd is not None and way == "inflight":
            socket.send_fds(a, [b"x"], [fd])
            os.close(fd)
        fd = os.open("h", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        os.unlink("h")
    try:
        os.write(fd, buf)
    except OSError as e:
        print(f"CHECK stopped={errno.errorcode[e.errno]}", flush=True)
        break
    wrote += 1
print(f"CHECK wrote={wrote}", flush=True)
"""


@pytest.fixture
def ext4_homes(tmp_path):
    """A 768 MiB ext4 in a loop file: a small disk for the homes."""
    img, mnt = tmp_path / "homes.img", tmp_path / "homes"
    subprocess.run(["truncate", "-s", "768M", str(img)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    mnt.mkdir()
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(img), str(mnt)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip(f"no ext4 loop file system here: {made.stderr.strip()[-200:]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_space_a_sandbox_holds_where_no_walk_sees_it_counts_toward_its_quota(
        start_service, ext4_homes):
    """The red team's H1: files unlinked while open (and sent through a Unix socket) filled
    the disk past max_home_mb in seconds, unseen by the walk of the home. Now each is ended at
    its quota by what it holds (/proc/<pid>/fd) or by the space that went where no home shows
    it while it wrote fastest; O_TMPFILE and openat2 are refused."""
    homes = ext4_homes / "h"
    svc = start_service({"hermes": {"runner": "acp", "toolsets": ["terminal"],
                                    "sandbox": {"mode": "bwrap", "max_home_mb": 64,
                                                "quota": "watch", "min_free_mb": 32}},
                         "paths": {"homes_dir": str(homes)}})
    base = shutil.disk_usage(ext4_homes).used
    peaks = {}
    for way in ("unlinked", "inflight"):
        sid = svc.post("/api/v1/sessions", json={"user_id": way}).json()["session_id"]
        home = homes / "users" / way
        home.mkdir(parents=True)
        (home / "hide.py").write_text(HIDE)
        peak, stop = [0], threading.Event()

        def sample(peak=peak, stop=stop):
            while not stop.wait(0.005):
                peak[0] = max(peak[0], shutil.disk_usage(ext4_homes).used - base)
        t = threading.Thread(target=sample)
        t.start()
        res = svc.post(f"/api/v1/sessions/{sid}/messages",
                       json={"message": terminal(f"python3 hide.py {way}")}, timeout=300)
        stop.set()
        t.join()
        peaks[way] = peak[0] / MIB
        assert (res.status_code, res.json()["code"]) == (507, "home_quota_exceeded"), \
            (way, res.text[-800:])
        # ended well before the 600 MiB it meant to write; measured ~75 MiB on a quiet
        # machine (bench/disk_overshoot.py): a bound, not the exact cap
        assert peaks[way] < 400, peaks
        # unlinked: counted in its home (/proc/<pid>/fd); in flight: no home shows it
        why = {"unlinked": f"user={way}: its home uses", "inflight": "where no home shows it"}
        wait_for(lambda: why[way] in svc.log(), f"the watcher's reason for {way}", 10)
        # its sandbox ended: what it held is given back
        wait_for(lambda: shutil.disk_usage(ext4_homes).used - base < 32 * MIB,
                 "the held space freed", 30)
    assert svc.get("/health").json()["status"] == "healthy"

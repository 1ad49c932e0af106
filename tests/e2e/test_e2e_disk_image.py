"""Home images (``hermes.sandbox.quota: image``; docs/sandbox.md §Home images): each home an
ext4 of its own, loop-mounted by the service, so a hostile agent — through Hermes's real
terminal tool, in real bubblewrap, on both runners — that hides what it writes where no walk
sees it (8 MiB unlinked files parked in socket queues, at 1, 10 and 50 MiB/s; unlinked files
held only by ``mmap``; two sandboxes of one user at once) is stopped by the kernel at its
quota (``ENOSPC`` inside), whatever the watcher sees. A home at its quota is refused 507 at
once on v1 and the panel, before Hermes starts, and ``home-trim`` is the way out.

Loop mounts need root, loop devices and ext4: the tests skip, saying which is missing, only
where one is (on a root host with them they run).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hermes_service.disk.image import image_problem, mount_options
from support.disk_writers import PARK
from support.fixtures import API_KEY, ROOT, wait_for
from support.sse_client import read_all

NO_IMAGES = image_problem(Path("/var/tmp"))
pytestmark = [pytest.mark.e2e,
              pytest.mark.sandbox,
              pytest.mark.skipif(NO_IMAGES is not None,
                                 reason=f"no loop-mounted home images here: {NO_IMAGES}")]

MIB = 1024 * 1024
QUOTA_MB = 32
#: what a home may hold past its quota: nothing (the image is its size); a MiB of slack
#: for the file system's rounding
SLACK_MB = 2


def terminal(command: str) -> str:
    return "[[tools:terminal " + json.dumps({"command": command}) + "]]"


def checks(answer: str) -> dict[str, str]:
    text = answer.replace("\\n", "\n")
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r'CHECK (\w+)=([^\n\\"]*)', text)}


@pytest.fixture
def homes(tmp_path):
    """A folder for the homes on a disk (tmp_path's), every mount under it unmounted after."""
    yield tmp_path / "homes"
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split(" ")[4]
        if point.startswith(str(tmp_path) + "/"):
            subprocess.run(["umount", point], capture_output=True)


def config(homes: Path, runner: str) -> dict:
    return {"hermes": {"runner": runner, "toolsets": ["terminal"], "timeout_seconds": 150,
                       "sandbox": {"mode": "bwrap", "quota": "image", "max_home_mb": QUOTA_MB,
                                   "min_free_mb": 16}},
            "mnote": {"runner": runner}, "paths": {"homes_dir": str(homes)}}


def first_turn(svc, user: str) -> tuple[str, Path]:
    """A session of ``user`` whose home exists (an image, mounted nodev,nosuid)."""
    sid = svc.post("/api/v1/sessions", json={"user_id": user}).json()["session_id"]
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "hello"})
    assert res.status_code == 200, res.text
    home = Path(svc.cfg["paths"]["homes_dir"]) / "users" / user
    opts = mount_options(home)
    assert opts is not None and {"ext4", "nodev", "nosuid"} <= opts, opts
    return sid, home


def image_mb(homes: Path, user: str) -> float:
    """What the home's image takes on the disk below (allocated blocks, MiB)."""
    return os.stat(homes / "home-images" / "users" / f"{user}.img").st_blocks * 512 / MIB


@pytest.mark.parametrize("runner", ["acp", "cli"])
def test_a_writer_hiding_in_socket_queues_or_mmap_stops_at_the_image_whatever_its_rate(
        start_service, homes, runner):
    svc = start_service(config(homes, runner))
    assert "a file system of its own per home" in svc.wait_log("disk: max_home_mb")
    sid, home = first_turn(svc, "hider")
    (home / "park.py").write_text(PARK)
    peak, stop = [0.0], threading.Event()

    def sample():
        while not stop.wait(0.01):
            peak[0] = max(peak[0], image_mb(homes, "hider"))
    t = threading.Thread(target=sample)
    t.start()
    try:
        res = svc.post(f"/api/v1/sessions/{sid}/messages", timeout=300,
                       json={"message": terminal("python3 park.py 1,10,50 mmap")})
    finally:
        stop.set()
        t.join()
    assert peak[0] <= QUOTA_MB + SLACK_MB, peak
    # (the watcher, a backstop, may end the fastest writer first: 507, never more than that)
    if res.status_code == 507:
        assert res.json()["code"] == "home_quota_exceeded", res.text
        return
    assert res.status_code == 200, res.text[-800:]
    got = checks(res.json()["response"])
    for rate in (1, 10, 50):
        assert got[f"park{rate}_err"] == "ENOSPC", got
        assert int(got[f"park{rate}_mb"]) <= QUOTA_MB, got
    assert got["mmap_end"] == "SIGBUS" and int(got["mmap_mb"]) < QUOTA_MB, got
    again = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "after"})
    assert again.status_code == 200, again.text         # its parked files went with it


def test_two_sandboxes_of_one_user_share_one_image(start_service, homes):
    svc = start_service(config(homes, "cli"))
    sid_a, home = first_turn(svc, "twin")
    sid_b = svc.post("/api/v1/sessions", json={"user_id": "twin"}).json()["session_id"]
    (home / "park.py").write_text(PARK)
    results: dict = {}

    def turn(sid):
        results[sid] = svc.post(f"/api/v1/sessions/{sid}/messages", timeout=300,
                                json={"message": terminal("python3 park.py 10")})
    threads = [threading.Thread(target=turn, args=(s,)) for s in (sid_a, sid_b)]
    for t in threads:
        t.start()
    peak = 0.0
    while any(t.is_alive() for t in threads):
        peak = max(peak, image_mb(homes, "twin"))
        threads[0].join(0.01)
    for t in threads:
        t.join()
    assert peak <= QUOTA_MB + SLACK_MB, peak
    # what the two held at once is the peak above; what each wrote is bounded alone (the
    # sum is not: a writer whose turn ends first frees its parked files for the other)
    for _sid, res in results.items():
        if res.status_code == 507:                      # the watcher's backstop
            assert res.json()["code"] == "home_quota_exceeded", res.text
            continue
        assert res.status_code == 200, res.text[-800:]
        got = checks(res.json()["response"])
        assert got["park10_err"] == "ENOSPC", got
        assert int(got["park10_mb"]) <= QUOTA_MB + SLACK_MB, got


P = "/api/hermes/client"
ACTOR = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "full"}


def panel_run(svc, message: str) -> tuple[int, str]:
    """A panel run of actor ``full``: (HTTP status, the code it failed with or "")."""
    sid = svc.post(f"{P}/sessions", headers=ACTOR, key=None,
                   json={"workspaceId": "ws_1", "documentId": "doc_1"}).json()["sessionId"]
    made = svc.post(f"{P}/runs", headers=ACTOR, key=None, json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message,
        "model": "hermes-agent", "pageContext": {"title": "t", "outline": []},
        "selectedBlockId": None, "selectedText": None})
    if made.status_code != 200:
        return made.status_code, made.json().get("code", "")
    events = [d for _, d in read_all(svc.url + f"{P}/events/{made.json()['runId']}", ACTOR)]
    last = events[-1]
    return 200, last.get("code", "") if last["event"] == "run.failed" else last["event"]


@pytest.mark.parametrize("runner", ["acp", "cli"])
def test_a_home_at_its_quota_is_507_at_once_and_home_trim_is_the_way_out(
        start_service, homes, model, runner):
    svc = start_service(config(homes, runner))
    sid, home = first_turn(svc, "full")
    st = os.statvfs(home)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize - MIB),
                    str(home / "big.bin")], check=True)
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "refused v1"})
    assert (res.status_code, res.json()["code"]) == (507, "home_quota_exceeded"), res.text
    assert "home-trim" in res.json()["detail"]
    status, code = panel_run(svc, "refused panel")
    assert code == "hermes_client_home_quota_exceeded", (status, code)
    # at once: refused before Hermes started, so the model never saw either
    assert not model.requests_with("refused v1") and not model.requests_with("refused panel")
    listed = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                             str(svc.config_path), "home-trim", "full"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "big.bin" in listed.stdout, listed.stderr
    trimmed = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                              str(svc.config_path), "home-trim", "full", "big.bin"],
                             capture_output=True, text=True, timeout=60)
    assert trimmed.returncode == 0 and "removed: big.bin" in trimmed.stdout, trimmed.stderr
    assert os.path.ismount(home)           # a live service uses it: home-trim left it mounted
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "room again"})
    assert res.status_code == 200 and "room again" in res.json()["response"], res.text
    assert panel_run(svc, "panel again") == (200, "run.completed")
    svc.stop()                             # the last process out unmounts
    wait_for(lambda: not os.path.ismount(home), "the home unmounted at the stop", 10)


def test_two_service_processes_on_one_data_dir_never_unmount_under_each_other(
        start_service, homes):
    """A rolling restart: the old process stops while the new one serves the same homes; the
    last one out unmounts (docs/sandbox.md §Home images)."""
    # the CLI runner: no warm process keeps a home busy, so only the owner rule keeps it
    old = start_service(config(homes, "cli"))
    sid, home = first_turn(old, "roller")
    (home / "kept.txt").write_text("mine")
    new = start_service(config(homes, "cli"))
    res = new.post(f"/api/v1/sessions/{sid}/messages", json={"message": "on the new one"})
    assert res.status_code == 200, res.text
    old.stop()
    assert os.path.ismount(home) and (home / "kept.txt").read_text() == "mine"
    res = new.post(f"/api/v1/sessions/{sid}/messages", json={"message": "still mounted"})
    assert res.status_code == 200 and "still mounted" in res.json()["response"], res.text
    assert "disk: unmounted" not in old.log()
    new.stop()
    wait_for(lambda: not os.path.ismount(home), "the home unmounted by the last one out", 10)
    assert not (home / "kept.txt").exists()         # (its files are in the image, unmounted)


#: fills the home with 4 KiB files until the kernel refuses (its inodes or its blocks)
SMALL = r"""
import errno, os
os.makedirs("small", exist_ok=True)
i, err = 0, "none"
try:
    while i < 200000:
        with open(f"small/{i}", "wb") as f:
            f.write(b"\1" * 4096)
        i += 1
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
print(f"CHECK small={i} err={err}", flush=True)
"""


@pytest.mark.parametrize("runner", ["acp", "cli"])
def test_an_agent_that_fills_its_image_gets_507_never_a_502(start_service, homes, runner):
    """Hermes cannot write its record in a home its agent filled to the last block or inode:
    the turn answers 507 home_quota_exceeded (or 200 if Hermes still could), never 502."""
    svc = start_service(config(homes, runner))
    sid, home = first_turn(svc, "smallfiles")
    (home / "small.py").write_text(SMALL)
    res = svc.post(f"/api/v1/sessions/{sid}/messages", timeout=300,
                   json={"message": terminal("python3 small.py")})
    assert res.status_code in (200, 507), res.text[-800:]
    if res.status_code == 507:
        assert res.json()["code"] == "home_quota_exceeded", res.text
    assert image_mb(homes, "smallfiles") <= QUOTA_MB
    st = os.statvfs(home)
    if st.f_bavail * st.f_frsize < 4 * MIB or st.f_favail < 64:
        again = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "full?"})
        assert (again.status_code, again.json()["code"]) == (507, "home_quota_exceeded")

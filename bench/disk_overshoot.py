"""How far past its quota a hostile agent gets, the watcher and a home image side by side
(docs/sandbox.md §Disk, §Home images): each way of writing that a walk of the home cannot
see, run by Hermes's real terminal tool in real bubblewrap, on a small ext4 in a loop file
(root only).

Per quota mode (``--quota``, default ``watch,image``) one service (ACP runner,
``max_home_mb`` 64, floor 64 MiB, homes on a 640 MiB ext4 loop file); per way one new user,
a first turn (which makes its home: under ``image`` its image, mounted), and one turn running
:data:`WRITER` with that way. A thread samples the file system's used space every 5 ms; per
way it prints the turn's status and code, the peak used space above where it started
(MiB: under ``image`` what the home's image took of the disk below) and the overshoot past
the quota (peak − 64); at the end one table, the modes side by side. Ways:

* ``named`` — 1 MiB pieces into named files (the walk sees them);
* ``unlinked`` — into a file unlinked while open (a new one at each ``EFBIG``);
* ``tmpfile`` — into an ``O_TMPFILE`` file;
* ``mmap`` — through a shared mapping of an unlinked file;
* ``inflight`` — into unlinked files sent through a Unix socket and closed (no fd left);
* ``parked`` — the patient writer (:data:`support.disk_writers.PARK`): 8 MiB unlinked files
  parked in socket queues, written at 10 MiB/s (below the watcher's 16 MiB/s rule), 400 MiB
  at most;
* ``procs`` — 8 processes, each into unlinked files;
* ``sparse`` — 1 MiB pieces 2 MiB apart in sparse files;
* ``small`` — 4 KiB files, as many as it can;
* ``chmod000`` — into a file of a folder made ``chmod 000`` (a service that is root reads it
  anyway: this row shows the walk, not the permission);
* ``runfolder`` — into the run folder;
* ``after`` — a daemonized process that keeps writing after the turn answered (sampled 5 s
  longer).

    sudo .venv/bin/python bench/disk_overshoot.py [--quota watch,image] [--ways a,b] [--checkout PATH]

``--checkout``: the checkout whose service runs (default this one), to compare before and
after a change. Figures, not asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WAYS = ("named", "unlinked", "tmpfile", "mmap", "inflight", "parked", "procs", "sparse",
        "small", "chmod000", "runfolder", "after")
QUOTA_MB = 64
MIB = 1 << 20

#: the agent's script: writes by the way named in argv[1] until refused or 400 MiB, holds
#: what it wrote 2 s, prints what it did
WRITER = r"""
import errno, mmap, os, signal, socket, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
way, buf, wrote, err = sys.argv[1], b"\xa5" * (1 << 20), 0, "none"
a, b = socket.socketpair()
held = []

def unlinked(d="."):
    p = os.path.join(d, "u%d" % len(held))
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(p)
    held.append(fd)
    return fd

def fill(new, limit=400):
    global wrote, err
    fd = new()
    while wrote < limit:
        try:
            os.write(fd, buf)
            wrote += 1
        except OSError as e:
            if e.errno == errno.EFBIG:
                fd = new()
                continue
            err = errno.errorcode.get(e.errno, str(e.errno))
            return

try:
    if way == "named":
        def named():
            held.append(os.open("n%d" % len(held), os.O_CREAT | os.O_WRONLY, 0o600))
            return held[-1]
        fill(named)
    elif way == "unlinked":
        fill(unlinked)
    elif way == "tmpfile":
        def tmpfile():
            held.append(os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600))
            return held[-1]
        fill(tmpfile)
    elif way == "mmap":
        while wrote < 400:
            fd = unlinked()
            os.ftruncate(fd, 32 << 20)
            m = mmap.mmap(fd, 32 << 20)
            os.close(fd)
            held[-1] = m
            for i in range(32):
                m[i << 20:(i + 1) << 20] = buf
                wrote += 1
    elif way == "inflight":
        def new():
            if held:
                socket.send_fds(a, [b"x"], [held[-1]])
                os.close(held.pop())
            return unlinked()
        while wrote < 400:
            fd = new()
            for _ in range(8):
                os.write(fd, buf)
                wrote += 1
    elif way == "procs":
        kids = []
        for _ in range(8):
            pid = os.fork()
            if pid == 0:
                fill(unlinked, 50)
                time.sleep(2)
                os._exit(0)
            kids.append(pid)
        for k in kids:
            os.waitpid(k, 0)
    elif way == "sparse":
        def new():
            held.append(os.open("s%d" % len(held), os.O_CREAT | os.O_WRONLY, 0o600))
            return held[-1]
        fd, i = new(), 0
        while wrote < 400:
            try:
                os.pwrite(fd, buf, i * (2 << 20))
                i, wrote = i + 1, wrote + 1
            except OSError as e:
                if e.errno != errno.EFBIG:
                    raise
                fd, i = new(), 0
    elif way == "small":
        os.mkdir("small")
        for i in range(120000):
            with open("small/%d" % i, "wb") as f:
                f.write(buf[:4096])
            wrote = i // 256
    elif way == "chmod000":
        os.mkdir("hide")
        fd = os.open("hide/f", os.O_CREAT | os.O_WRONLY, 0o600)
        os.chmod("hide", 0)
        held.append(fd)
        fill(lambda: fd)
    elif way == "runfolder":
        fill(lambda: unlinked("/run/hermes-service"))
    elif way == "after":
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(1.5)
                fill(unlinked)
                time.sleep(10)
            os._exit(0)
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
print("CHECK way=%s wrote=%d err=%s" % (way, wrote, err), flush=True)
time.sleep(2)
"""


def ext4(img: Path, mnt: Path) -> None:
    subprocess.run(["truncate", "-s", "640M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)


def used_mb(path: Path) -> float:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize / MIB


def run_mode(quota: str, ways: list[str], tmp: Path, homes: Path, model) -> dict:
    """One service with ``hermes.sandbox.quota`` ``quota``; per way (status, code, peak)."""
    import requests

    from support.disk_writers import PARK
    from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "hermes": {"runner": "acp", "toolsets": ["terminal"], "timeout_seconds": 60,
                   "sandbox": {"mode": "bwrap", "max_home_mb": QUOTA_MB, "quota": quota,
                               "min_free_mb": 64}},
        "paths": {"homes_dir": str(homes / f"h-{quota}"), "data_dir": str(tmp / f"d-{quota}")}})
    svc = ServiceProcess(tmp, cfg).start()
    head = {"X-API-Key": API_KEY}
    out = {}
    try:
        for way in ways:
            user = f"u-{way}"
            sid = requests.post(svc.url + "/api/v1/sessions", json={"user_id": user},
                                headers=head, timeout=30).json()["session_id"]
            requests.post(svc.url + f"/api/v1/sessions/{sid}/messages", json={"message": "hi"},
                          headers=head, timeout=120)          # its home made (an image)
            home = homes / f"h-{quota}" / "users" / user
            (home / "w.py").write_text(PARK if way == "parked" else WRITER)
            base, peak, stop = used_mb(homes), [0.0], threading.Event()

            def sample(base=base, peak=peak, stop=stop):
                while not stop.is_set():
                    peak[0] = max(peak[0], used_mb(homes) - base)
                    time.sleep(0.005)
            t = threading.Thread(target=sample)
            t.start()
            arg = "10" if way == "parked" else way             # PARK: its rate, MiB/s
            msg = "[[tools:terminal " + json.dumps({"command": f"python3 w.py {arg} 2>&1"}) + "]]"
            r = requests.post(svc.url + f"/api/v1/sessions/{sid}/messages",
                              json={"message": msg}, headers=head, timeout=300)
            if way == "after":
                time.sleep(5)
            stop.set()
            t.join()
            body = r.json()
            said = [ln for ln in str(body.get("response", "")).replace("\\n", "\n").splitlines()
                    if "CHECK" in ln][:1]
            out[way] = (r.status_code, body.get("code", "-"), peak[0])
            print(f"{quota:6} {way:10} {r.status_code:>6} {body.get('code', '-'):22} "
                  f"{peak[0]:8.0f} {peak[0] - QUOTA_MB:10.0f}  "
                  f"{said[0].strip()[:60] if said else ''}", flush=True)
            subprocess.run(["chmod", "-R", "u+rwx", str(home)], capture_output=True)
            subprocess.run(["find", str(home), "-mindepth", "1", "-not", "-name", ".hermes",
                            "-not", "-path", "*/.hermes/*", "-delete"], capture_output=True)
    finally:
        svc.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--quota", default="watch,image", help="the modes, side by side")
    args = ap.parse_args()
    sys.path[:0] = [str(Path(args.checkout) / "tests"), args.checkout]
    from hermes_service.scripted_model import ScriptedModel
    tmp = Path(tempfile.mkdtemp(prefix="disk-overshoot-"))
    homes = tmp / "homes"
    ext4(tmp / "homes.img", homes)
    model = ScriptedModel("scripted-model").start()
    modes, ways = args.quota.split(","), args.ways.split(",")
    print(f"checkout {args.checkout}; quota {QUOTA_MB} MiB, ext4 640 MiB, floor 64 MiB; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':6} {'way':10} {'status':>6} {'code':22} {'peak MiB':>8} {'past quota':>10}"
          "  agent")
    results = {}
    try:
        for quota in modes:
            results[quota] = run_mode(quota, ways, tmp, homes, model)
    finally:
        model.stop()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            if line.split(" ")[4].startswith(str(homes) + "/"):
                subprocess.run(["umount", line.split(" ")[4]], capture_output=True)
        subprocess.run(["umount", str(homes)], capture_output=True)
    print("\npeak MiB above the start (the turn's status), quota " + str(QUOTA_MB) + " MiB")
    print(f"{'way':10}" + "".join(f" {m:>14}" for m in modes))
    for way in ways:
        cells = [results[m].get(way) for m in modes]
        print(f"{way:10}" + "".join(f" {c[2]:8.0f} ({c[0]})" if c else f" {'-':>14}"
                                    for c in cells))


if __name__ == "__main__":
    main()

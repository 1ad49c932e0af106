"""Scripts a hostile agent runs in its sandbox to hold disk where no walk of its home sees it
(docs/sandbox.md §Disk): shared by tests/e2e/test_e2e_disk_image.py and
bench/disk_overshoot.py."""

#: argv[1]: rates (MiB/s, comma-separated). At each rate it writes 8 MiB unlinked files,
#: each parked in a socket's queue once full (in no /proc/<pid>/fd: no walk sees it), and
#: each time takes the oldest parked one out for one short write and parks it again, until
#: the kernel refuses; then it drops them all. Then two unlinked 16 MiB files held only by
#: mmap, written through the mapping (a full file system: SIGBUS).
PARK = r"""
import errno, mmap, os, signal, socket, sys, time
MIB = 1 << 20
buf = b"\xa5" * MIB

def parked(fd):
    a, b = socket.socketpair()
    socket.send_fds(a, [b"x"], [fd])
    return a, b

def park(rate):
    held, fd, wrote, err, t0 = [], None, 0, "none", time.monotonic()
    while wrote < 400:
        if fd is None or wrote % 8 == 0:
            if fd is not None:
                held.append(parked(fd))
                os.close(fd)
                fd = None
            if len(held) > 1:                      # the oldest out, one short write, back
                a, b = held.pop(0)
                _, fds, _, _ = socket.recv_fds(b, 1, 1)
                a.close(); b.close()
                try:
                    os.write(fds[0], b"\1" * 4096)
                except OSError as e:
                    err = errno.errorcode.get(e.errno, str(e.errno))
                held.append(parked(fds[0]))
                os.close(fds[0])
                if err != "none":
                    break
            fd = os.open("p", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            os.unlink("p")
        try:
            os.write(fd, buf)
        except OSError as e:
            err = errno.errorcode.get(e.errno, str(e.errno))
            break
        wrote += 1
        lag = t0 + wrote / rate - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    if fd is not None:
        os.close(fd)
    for a, b in held:
        a.close(); b.close()
    return wrote, err

def mapped():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        maps = []
        for _ in range(2):
            fd = os.open("m", os.O_CREAT | os.O_RDWR, 0o600)
            os.unlink("m")
            os.ftruncate(fd, 16 * MIB)
            maps.append(mmap.mmap(fd, 16 * MIB))
            os.close(fd)
        for m in maps:
            for i in range(16):
                m[i * MIB:(i + 1) * MIB] = buf
                os.write(w, b"x")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    n = len(os.read(r, 64))
    return n, (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else "exit")

for rate in (int(x) for x in sys.argv[1].split(",")):
    wrote, err = park(rate)
    print(f"CHECK park{rate}_mb={wrote}", flush=True)
    print(f"CHECK park{rate}_err={err}", flush=True)
if len(sys.argv) > 2:
    n, how = mapped()
    print(f"CHECK mmap_mb={n}", flush=True)
    print(f"CHECK mmap_end={how}", flush=True)
"""

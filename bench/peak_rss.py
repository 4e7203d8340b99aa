"""Peak RSS (VmHWM) of pstrain's workers and servers while a bench run lasts.

    peak_rss.py OUT [WORKER_PATTERN ...]

Polls /proc every 0.2 s until SIGTERM, then writes "workers servers" to
OUT: the largest VmHWM of each kind in MiB (0: none ran). A server is a
pstrain-server process; a worker a pstrain-worker or one whose command line
holds a WORKER_PATTERN (a training script's name).
"""
import os
import signal
import sys
import time

patterns = [b"pstrain-worker"] + [p.encode() for p in sys.argv[2:]]
peak = {"worker": 0, "server": 0}
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open("/proc/%s/cmdline" % pid, "rb").read().replace(b"\0", b" ")
            kind = ("server" if b"pstrain-server" in cmd else
                    "worker" if any(p in cmd for p in patterns) else None)
            if kind:
                for line in open("/proc/%s/status" % pid):
                    if line.startswith("VmHWM:"):
                        peak[kind] = max(peak[kind], int(line.split()[1]) // 1024)
        except OSError:
            pass
    time.sleep(0.2)
open(sys.argv[1], "w").write("%d %d\n" % (peak["worker"], peak["server"]))

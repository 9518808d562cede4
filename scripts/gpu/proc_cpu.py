"""Where the CPU goes while a benchmark runs: each process's user+system seconds over a window, as a share of one core.

    python scripts/gpu/proc_cpu.py OUT.txt &   # then run the benchmark; `kill -TERM` the sampler when it ends

A server whose API process sits at ~100% of a core while the device idles is host-bound in that process; the
same for the engine core or the benchmark client. Processes that start inside the window count from their start.
"""
import signal
import sys
import threading
import time

import psutil


def _snapshot() -> dict[int, tuple[float, str]]:
    """pid -> (cpu seconds so far, short command line)."""
    seen = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])[:150]
        seen[proc.info["pid"]] = (times.user + times.system, cmd)
    return seen


def main() -> None:
    out_path = sys.argv[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    start, t0 = _snapshot(), time.monotonic()
    latest = start
    while not stop.wait(1.0):
        # keeps processes that exited inside the window at their last reading, and each one's first command line
        # (an exited process that is not yet reaped reads as an empty one)
        latest = {pid: (cpu, latest[pid][1] if pid in latest and latest[pid][1] else cmd)
                  for pid, (cpu, cmd) in {**latest, **_snapshot()}.items()}
    wall = time.monotonic() - t0
    rows = []
    for pid, (cpu, cmd) in latest.items():
        used = cpu - start.get(pid, (0.0, ""))[0]
        if used > 0.05 * wall:
            rows.append((used, pid, cmd))
    with open(out_path, "w") as f:
        f.write(f"window {wall:.1f} s; processes above 5% of a core:\n")
        for used, pid, cmd in sorted(rows, reverse=True):
            f.write(f"{100 * used / wall:6.1f}%  pid {pid:<7d} {cmd}\n")


if __name__ == "__main__":
    main()

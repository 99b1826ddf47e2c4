"""CPU time of other processes, from /proc: what a benchmark reports beside wall time.

With several ranks and daemons on this machine's two cores, wall time mixes everyone's CPU; the CPU
of one process (every thread, user and kernel) is what a node with cores of its own would spend.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far (clock-tick resolution, 10 ms here);
    ProcessLookupError once it has ended (an unreaped child stays readable, as a zombie)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces or ')'
    if fields[0] in ("Z", "X"):
        raise ProcessLookupError(f"process {pid} has ended")
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuSampler:
    """Samples the CPU of `pids` every `period_s` in a thread, against time.time(), so that a window
    known only afterwards (from a trainer's timestamps) can be cut out of it: `between(t0, t1)`."""

    def __init__(self, pids: Sequence[int], period_s: float = 0.01) -> None:
        self._pids = list(pids)
        self._period = period_s
        self._times: list[float] = []
        self._cpu: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.time()
            try:
                cpu = [cpu_seconds(p) for p in self._pids]
            except (FileNotFoundError, ProcessLookupError):
                return  # a process ended: the window of interest is over
            self._cpu.append(cpu)  # first: a reader that sees the time sees its sample
            self._times.append((before + time.time()) / 2)
            self._stop.wait(self._period)

    def _at(self, t: float) -> list[float]:
        """The CPU of each process at t, interpolated between the samples either side of it."""
        i = bisect.bisect_right(self._times, t)
        if i == 0 or i == len(self._times):
            raise ValueError(f"no CPU samples either side of {t:.3f} (they span {self._times[0]:.3f}.."
                             f"{self._times[-1]:.3f}): did a process end early?")
        t_a, t_b = self._times[i - 1], self._times[i]
        w = (t - t_a) / (t_b - t_a) if t_b > t_a else 0.0
        return [a + w * (b - a) for a, b in zip(self._cpu[i - 1], self._cpu[i], strict=True)]

    def between(self, t0: float, t1: float) -> list[float]:
        """Each process's CPU seconds from wall time t0 to t1 (both time.time()); ValueError where
        the samples do not reach both (a process ended, or the window is still open)."""
        deadline = time.time() + 10 * self._period  # a window that just closed: its next sample is due
        while (not self._times or self._times[-1] < t1) and self._thread.is_alive() and time.time() < deadline:
            time.sleep(self._period)
        if not self._times:
            raise ValueError("no CPU samples")
        return [b - a for a, b in zip(self._at(t0), self._at(t1), strict=True)]

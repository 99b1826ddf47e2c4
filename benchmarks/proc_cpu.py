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
    """utime + stime of every thread of `pid` so far (clock-tick resolution, 10 ms here)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces or ')'
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
            try:
                cpu = [cpu_seconds(p) for p in self._pids]
            except (FileNotFoundError, ProcessLookupError):
                return  # a process ended: the window of interest is over
            self._times.append(time.time())
            self._cpu.append(cpu)
            self._stop.wait(self._period)

    def _at(self, t: float) -> list[float]:
        i = bisect.bisect_right(self._times, t) - 1  # the last sample at or before t
        if i < 0:
            raise ValueError(f"no CPU sample at or before {t:.3f} (the first is at {self._times[0]:.3f})")
        return self._cpu[i]

    def between(self, t0: float, t1: float) -> list[float]:
        """Each process's CPU seconds from wall time t0 to t1 (both time.time())."""
        if not self._times or t1 > self._times[-1] + 2 * self._period + 0.1:
            raise ValueError(f"the samples end before {t1:.3f}: did a process end early?")
        return [b - a for a, b in zip(self._at(t0), self._at(t1), strict=True)]

"""Where a process's startup goes (issue 35, cold start): the phases from the
process's own start to its first ready moment, timed as they pass."""
from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the
    interpreter and the imports before anything here could time them."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """phases: [(name, seconds)] in order, the first "imports" (the process's
    age when the clock was made) where the platform tells it."""

    def __init__(self) -> None:
        age = process_age_s()
        self.phases: list[tuple[str, float]] = [("imports", age)] if age is not None else []
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or the clock's start) was `phase`."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._t))
        self._t = now

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.phases)

    def summary(self) -> str:
        return ", ".join(f"{name} {s:.2f} s" for name, s in self.phases) + f"; total {self.total_s:.2f} s"

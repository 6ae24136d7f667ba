"""Hang detection: a rank that makes no progress for `timeout` seconds ends the job.

A collective whose peer stopped answering blocks inside the communication library, where Python
signal handlers cannot run, and torch's sub-groups default to a 30-minute timeout whatever the
default group's is. A daemon thread watching the step loop's heartbeat catches both: it prints
which rank waited, in which phase of which step, and exits the process; the DeepSpeed launcher
then ends the other ranks.
"""

import os
import sys
import threading
import time

from hybrid3d.errors import EXIT_HANG


class Watchdog:
    EXIT_CODE = EXIT_HANG

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._phase = "start-up"
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hybrid3d-watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str) -> None:
        """Mark progress; `phase` names what comes next ('step 12', 'save at step 12', ...)."""
        self._phase = phase
        self._last = time.monotonic()

    def stop(self) -> None:
        """Stop watching and join the thread (idempotent)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stopped.wait(min(5.0, self.timeout_s / 10)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"error: rank {self.rank}: no progress for {idle:.0f} s in {self._phase} "
                      f"(timeout_seconds {self.timeout_s:g}): a rank stopped answering or a collective hung; "
                      "ending the job", file=sys.stderr, flush=True)
                os._exit(self.EXIT_CODE)

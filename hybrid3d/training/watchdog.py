"""Hang detection: a rank that makes no progress for `timeout` seconds ends the job.

A collective whose peer stopped answering blocks inside the communication library, where Python
signal handlers cannot run, and torch's sub-groups default to a 30-minute timeout whatever the
default group's is. A daemon thread watching the step loop's heartbeat catches both: it prints
which rank waited, in which phase of which step, and exits the process; the DeepSpeed launcher
then ends the other ranks. A collective that fails because its peer is gone (gloo's "Connection closed by
peer" when a rank or node dies) leaves the watched block as `PeerLostError`, one line naming the phase.
"""

import os
import sys
import threading
import time

from hybrid3d.errors import EXIT_HANG, PeerLostError


# What gloo and NCCL say when the other end of a collective is gone (torch raises them as RuntimeError or its
# DistBackendError subclass).
LOST_PEER_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
                      "NCCL communicator was aborted", "socket closed")


def lost_peer(error: BaseException) -> str:
    """The library's words for a vanished peer, up to the end of its sentence ('' when it is another error)."""
    text = " ".join(str(error).split())
    for message in LOST_PEER_MESSAGES:
        start = text.find(message)
        if start >= 0:
            end = text.find(". ", start)
            return text[start:end if end >= 0 else len(text)]
    return ""


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

    @property
    def phase(self) -> str:
        return self._phase

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

    def __exit__(self, kind, error, traceback) -> None:
        self.stop()
        if isinstance(error, RuntimeError) and lost_peer(error):
            raise PeerLostError(f"rank {self.rank}: lost contact with another rank in {self._phase} "
                                f"({lost_peer(error)}): a rank or its node stopped; resume from the last committed "
                                "checkpoint with --checkpoint.load latest") from error

    def _watch(self) -> None:
        while not self._stopped.wait(min(5.0, self.timeout_s / 10)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"error: rank {self.rank}: no progress for {idle:.0f} s in {self._phase} "
                      f"(timeout_seconds {self.timeout_s:g}): a rank stopped answering or a collective hung; "
                      "ending the job", file=sys.stderr, flush=True)
                os._exit(self.EXIT_CODE)

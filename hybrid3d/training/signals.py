"""A stop requested by SIGTERM/SIGINT, agreed by every rank at a step boundary."""

import signal

import deepspeed.comm as dist
import torch


class StopRequest:
    """SIGTERM/SIGINT set a flag; every step all ranks agree on it (one tiny all-reduce), so they
    stop at the same step, save, and exit cleanly even if only one rank got the signal.

    `all_reduce_max` (int -> int over all ranks) is injectable for tests; by default it is one
    all-reduce of a 1-element tensor on `device`."""

    def __init__(self, device="cpu", all_reduce_max=None, install: bool = True):
        self.signal_name = None
        self.device = device
        self._all_reduce_max = all_reduce_max or self._collective_max
        if install:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def _collective_max(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def agreed(self) -> bool:
        return bool(self._all_reduce_max(1 if self.signal_name else 0))

    def who(self) -> str:
        """'SIGTERM (rank 1)': which signals reached which ranks (a collective). A SIGINT is a Ctrl-C in the
        terminal (it reaches every process of the job, and DeepSpeed's launcher turns its own into SIGTERMs to
        the ranks): 'Ctrl-C (SIGINT)'."""
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.signal_name)
        if "SIGINT" in names:
            return "Ctrl-C (SIGINT)"
        return ", ".join(f"{name} (rank {rank})" for rank, name in enumerate(names) if name)

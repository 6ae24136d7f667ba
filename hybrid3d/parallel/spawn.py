"""Run functions on N ranks spawned on this machine (tests and benchmarks).

Each rank gets the environment DeepSpeed's launcher would set, initialises `deepspeed.comm`
(gloo on the CPU, NCCL with DS_ACCELERATOR=cuda), runs `fn(rank, world_size, *args)` and saves
its return value, which the caller gets back.

Starting a world costs seconds on 2 cores (imports and the process group dominate), so a
`WorldPool` keeps one world per size alive and runs call after call in it, the way Megatron's unit
tests run the whole suite under one torchrun. Each call builds its own groups and engines; a call
that fails retires its world (its ranks may be out of step), and so does one after which a rank holds
more than RETIRE_THREADS threads (the groups of earlier runs that could not be freed); the next call of
that size starts a fresh one. `run_world` is one call in a world of its own. A world's shared-memory segments are
removed when it ends.

A pool made with `preload=True` (the test suite's) forks its ranks from one server process that imported torch,
DeepSpeed, transformers and hybrid3d's trainer once (multiprocessing's "forkserver" with a preload list), instead of
starting each rank as a fresh interpreter ("spawn") that imports them again: the first run of every rank of every
world otherwise pays those imports (measured on 2 cores: test_engine.py's world of 8 took 25 s for its first call
spawned, 6 s forked; the module 122 s -> 90 s). The server never initialises an accelerator or a thread pool, so a
forked rank starts as a spawned one would. It imports DeepSpeed, which fixes its accelerator at import, so it serves
only CPU worlds (DS_ACCELERATOR unset or "cpu", the accelerator `_init_rank` gives a rank by default); a world on
another accelerator is spawned.
"""

import contextlib
import gc
import io
import multiprocessing.forkserver
import os
import queue
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from hybrid3d.ds_internals.cpu_info import cpu_info
from hybrid3d.ds_internals.process_groups import destroy_engines, release_process_groups
from hybrid3d.ds_internals.shm_buffers import remove_shm_buffers
from hybrid3d.parallel.threads import threads_per_rank, usable_cores
from hybrid3d.parallel.world import start_world

CALL_TIMEOUT_S = 1800  # a call that runs longer than this is taken as hung: its world is retired
# A rank with more threads than this after a call is retired with its world. On gloo each process group keeps
# three threads (two run loops, one connection loop) while it lives. Most runs free theirs, but a pipeline's last
# stage keeps ~15 more after each pipeline run (measured rank by rank over test_engine's 39 runs in the world of 4:
# rank 0 ended at 74 threads, rank 3 at 352; no Python object holds those groups by then). Idle threads cost little,
# yet the same 39 runs took 54 s in a world at 352-698 threads and 74 s at 698-1000; starting a world of 4 costs
# ~10 s on 2 cores, which a bound of 200 paid three more times per suite.
RETIRE_THREADS = 600
# What a preloading pool's fork server imports once for every rank it forks (see the module docstring)
PRELOAD = ["torch", "deepspeed", "transformers", "hybrid3d.training.trainer", "deepspeed.runtime.pipe.engine"]


def _thread_count() -> int:
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:  # not Linux: no count, no retirement
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(threads_per_rank(world_size, usable_cores()))
    held = io.StringIO()  # DeepSpeed prints a line per op it loads (the shared-memory collectives): not the caller's
    try:
        with contextlib.redirect_stdout(held):
            start_world(backend="nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo")
    except BaseException:
        sys.stdout.write(held.getvalue())  # what a diagnosis may need
        raise


def end_run() -> None:
    """On every rank of a pooled world, between two runs (calls, or runs inside one call): free what the run left."""
    import deepspeed.comm as dist

    dist.barrier()  # every rank is done with the run's groups
    destroy_engines()  # the engines the run left, which would keep its groups and their threads
    release_process_groups()  # the next run builds its own
    gc.collect()  # the run's engines (destroyed above) and models, before the next run measures memory
    # What survived that collection lives as long as the rank (modules, caches: ~5e5 objects once torch, DeepSpeed
    # and transformers are in): kept out of later collections, which then scan only the next run's objects. Each
    # automatic full collection inside a run would otherwise scan all of them (~0.7 s each, several per run).
    # After destroy_engines: a frozen engine would be out of its gc.get_objects() search.
    gc.freeze()


def _serve(rank, world_size, port, inbox, outbox):
    """A rank of a pooled world: run each (fn, args, result path) from `inbox` until None arrives."""
    import deepspeed.comm as dist

    _init_rank(rank, world_size, port)
    gc.freeze()  # torch and DeepSpeed's modules, before the first run (end_run freezes what each run added)
    while (call := inbox.get()) is not None:
        fn, args, path = call
        try:
            result = fn(rank, world_size, *args)
            torch.save(result, path)
            del result
            end_run()
            outbox.put((rank, None, _thread_count()))
        except BaseException:  # noqa: BLE001 - reported to the caller, which retires this world
            outbox.put((rank, traceback.format_exc(), 0))
    dist.barrier()
    dist.destroy_process_group()


def _rank_context(preload: bool):
    """How a world's ranks start: forked from the preloaded server (CPU worlds of a preloading pool), else spawned."""
    if not preload or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    cpu_info()  # probed here, once, and inherited by the server and every rank it forks (ds_internals/cpu_info.py)
    previous = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"  # the server's environment, fixed when it starts (once per process)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["DS_ACCELERATOR"]
    return context


class _World:
    def __init__(self, world_size: int, preload: bool = False):
        context = _rank_context(preload)
        self.size, self.port = world_size, free_port()
        self.inboxes = [context.SimpleQueue() for _ in range(world_size)]
        self.outbox = context.Queue()
        self.ranks = [context.Process(target=_serve, args=(r, world_size, self.port, self.inboxes[r], self.outbox),
                                      daemon=True) for r in range(world_size)]
        for process in self.ranks:
            process.start()

    def call(self, fn, args, paths, timeout: float) -> str | None:
        """Run one call on every rank; None when all succeeded, else the first failure's report."""
        for inbox, path in zip(self.inboxes, paths):
            inbox.put((fn, args, path))
        self.threads = 0
        deadline, finished, failure = time.monotonic() + timeout, 0, None
        while finished < self.size:
            try:
                rank, error, threads = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.ranks) if p.exitcode is not None]
                if dead:
                    return failure or f"rank {dead[0]} of the world of {self.size} exited ({self.ranks[dead[0]].exitcode})"
                if time.monotonic() > deadline:
                    return failure or f"the call did not finish within {timeout:.0f} s on every rank"
                continue
            finished += 1
            self.threads = max(self.threads, threads)
            if error is not None and failure is None:
                failure = f"rank {rank}:\n{error}"
                deadline = min(deadline, time.monotonic() + 30)  # the others may wait on it in a collective
        return failure

    def close(self, graceful: bool) -> None:
        if graceful:
            for inbox in self.inboxes:
                inbox.put(None)
            for process in self.ranks:
                process.join(timeout=60)
        for process in self.ranks:
            if process.is_alive():
                process.kill()
                process.join()
        remove_shm_buffers("127.0.0.1", self.port)


class WorldPool:
    """One spawned world per size, kept for many calls (see the module docstring)."""

    def __init__(self, preload: bool = False):
        """`preload`: fork CPU worlds' ranks from a server that imported PRELOAD once (the module docstring)."""
        self._worlds: dict[int, _World] = {}
        self._preload = preload

    def run(self, fn, world_size: int, result_dir: str, *args, timeout: float = CALL_TIMEOUT_S) -> list:
        """Run `fn(rank, world_size, *args)` on every rank of the world of `world_size`; return each rank's result.

        `fn` must be importable by name (spawned processes re-import it); results go through `result_dir`."""
        os.makedirs(result_dir, exist_ok=True)
        paths = [os.path.join(result_dir, f"rank{r}.pt") for r in range(world_size)]
        world = self._worlds.get(world_size)
        if world is None:
            world = self._worlds[world_size] = _World(world_size, self._preload)
        failure = world.call(fn, args, paths, timeout)
        if failure is not None:
            del self._worlds[world_size]
            world.close(graceful=False)
            raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} failed in a world of {world_size}: {failure}")
        if world.threads > RETIRE_THREADS:  # the next call of this size starts a fresh world
            del self._worlds[world_size]
            world.close(graceful=True)
        # The results are this run's own objects (dicts of tensors and plain data).
        return [torch.load(path, weights_only=False) for path in paths]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close(graceful=True)
        self._worlds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_world(fn, world_size: int, result_dir: str, *args) -> list:
    """Run `fn(rank, world_size, *args)` once on `world_size` freshly spawned ranks; return each rank's result."""
    with WorldPool() as pool:
        return pool.run(fn, world_size, result_dir, *args)

"""Pipeline schedules as data: each rank's order of forward and backward passes, a timed run of those
orders, the bubble each schedule should have, and DeepSpeed instructions for the interleaved schedule.

Notation of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2): p pipeline ranks, m micro-batches per step, v model chunks per rank. The model is cut
into S stages. Rank r runs
- 1F1B (PipeDream-Flush; DeepSpeed's TrainSchedule): stage r (S = p);
- interleaved 1F1B: stages r, r + p, ..., r + (v-1)·p as its chunks 0..v-1 (S = v·p, Megatron's
  round-robin placement);
- DualPipeV (DeepSeek-V3 report, 2024; DeepSpeed's DualPipeVSchedule): stages r and 2p-1-r (S = 2p).
A forward F(i, s) of micro-batch i on stage s needs F(i, s-1); a backward B(i, s) needs F(i, s) and
B(i, s+1). The ideal bubble, the fraction of p ranks' step time spent idle with equal stages and free
communication, is (p-1)/(m+p-1) for 1F1B and (p-1)/(v·m+p-1) for interleaved 1F1B.
"""

from dataclasses import dataclass
from functools import lru_cache

from deepspeed.runtime.pipe import schedule as ds_schedule

from hybrid3d.errors import LayoutError

SCHEDULES = ("1f1b", "interleaved", "dualpipev")


@dataclass(frozen=True)
class PassOp:
    forward: bool
    micro_batch: int
    stage: int  # in [0, S)

    def __str__(self):
        return f"{'F' if self.forward else 'B'}{self.micro_batch}@{self.stage}"


def one_f_one_b_order(p: int, m: int, rank: int, forward_only: bool = False) -> list[PassOp]:
    """PipeDream-Flush: p-1-r warm-up forwards, then one forward and one backward in turn, then the rest."""
    if forward_only:
        return [PassOp(True, i, rank) for i in range(m)]
    warmup = min(p - 1 - rank, m)
    order = [PassOp(True, i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [PassOp(True, warmup + i, rank), PassOp(False, i, rank)]
    return order + [PassOp(False, i, rank) for i in range(m - warmup, m)]


def interleaved_order(p: int, v: int, m: int, rank: int, forward_only: bool = False) -> list[PassOp]:
    """Megatron's interleaved 1F1B order on rank r (m a multiple of p).

    Virtual micro-batch k runs micro-batch (k // (p·v))·p + k % p on chunk (k % (p·v)) // p forward, and on
    chunk v-1-that backward: groups of p micro-batches go through one chunk, then the next. Warm-up is
    2·(p-1-r) + (v-1)·p forwards, then one forward and one backward in turn."""
    if m % p:
        raise LayoutError(f"the interleaved schedule needs micro-batches ({m}) divisible by pipeline ranks ({p})")
    total = m * v

    def op(k: int, forward: bool) -> PassOp:
        within = k % (p * v)
        chunk = within // p if forward else v - 1 - within // p
        return PassOp(forward, (k // (p * v)) * p + k % p, rank + chunk * p)

    if forward_only:
        return [op(k, True) for k in range(total)]
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    order = [op(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(warmup + k, True), op(k, False)]
    return order + [op(k, False) for k in range(total - warmup, total)]


def dualpipev_order(p: int, m: int, rank: int, forward_only: bool = False) -> list[PassOp]:
    """The passes of DeepSpeed's DualPipeVSchedule on rank r, read off its instructions: phase 0 runs stage r,
    phase 1 stage 2p-1-r; buffer `phase·m + i` holds micro-batch i."""
    order = []
    for step in ds_schedule.DualPipeVSchedule(m, p, rank, forward_only=forward_only).steps():
        for cmd in step:
            if isinstance(cmd, (ds_schedule.ForwardPass, ds_schedule.BackwardPass)):
                phase = cmd.kwargs["phase"]
                stage = rank if phase == 0 else 2 * p - 1 - rank
                order.append(PassOp(isinstance(cmd, ds_schedule.ForwardPass), cmd.buffer_id - phase * m, stage))
    return order


def schedule_orders(schedule: str, p: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[PassOp]]:
    """Every rank's order for `schedule` (one of SCHEDULES)."""
    if schedule == "1f1b":
        return [one_f_one_b_order(p, m, r, forward_only) for r in range(p)]
    if schedule == "interleaved":
        return [interleaved_order(p, v, m, r, forward_only) for r in range(p)]
    if schedule == "dualpipev":
        return [dualpipev_order(p, m, r, forward_only) for r in range(p)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


@lru_cache(maxsize=256)
def cached_orders(schedule: str, p: int, m: int, v: int = 1) -> tuple[tuple[PassOp, ...], ...]:
    """`schedule_orders`, kept: the planner asks for the same orders in many rows (its activation bytes and, for
    DualPipeV, its bubble), and DualPipeV's come from walking DeepSpeed's instructions, the largest share of a plan."""
    return tuple(tuple(order) for order in schedule_orders(schedule, p, m, v))


def num_stages(schedule: str, p: int, v: int = 1) -> int:
    return {"1f1b": p, "interleaved": v * p, "dualpipev": 2 * p}[schedule]


@dataclass
class Timeline:
    """Start and end time of every op of every rank's order."""

    orders: list[list[PassOp]]
    starts: list[list[float]]
    ends: list[list[float]]

    @property
    def makespan(self) -> float:
        return max(e[-1] for e in self.ends if e)

    def bubble_fraction(self) -> float:
        """Idle share of the p ranks' time from the first op to the last."""
        busy = sum(e - s for st, en in zip(self.starts, self.ends) for s, e in zip(st, en))
        return 1.0 - busy / (len(self.orders) * self.makespan)


def run_timeline(orders: list[list[PassOp]], forward_time: float = 1.0, backward_time: float = 2.0,
                 stage_times: dict[int, tuple[float, float]] | None = None) -> Timeline:
    """Run every rank's order as early as its dependencies allow (communication free, every stage taking
    `forward_time` and `backward_time` per pass, or stage σ its own (forward, backward) = `stage_times[σ]`).
    Raises RuntimeError (a bug in the orders) if they deadlock."""
    stages = 1 + max(op.stage for order in orders for op in order)
    done: dict[tuple, float] = {}  # (forward, micro_batch, stage) -> end time
    starts = [[] for _ in orders]
    ends = [[] for _ in orders]
    position = [0] * len(orders)
    free_at = [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                op = order[position[rank]]
                needs = _dependencies(op, stages)
                if any(n not in done for n in needs):
                    break
                start = max([free_at[rank]] + [done[n] for n in needs])
                forward, backward = stage_times[op.stage] if stage_times else (forward_time, backward_time)
                end = start + (forward if op.forward else backward)
                done[(op.forward, op.micro_batch, op.stage)] = end
                starts[rank].append(start)
                ends[rank].append(end)
                free_at[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[position[r]]) for r, o in enumerate(orders) if position[r] < len(o)}
            raise RuntimeError(f"pipeline orders deadlock; next passes per rank: {stuck}")
    return Timeline(orders, starts, ends)


def _dependencies(op: PassOp, stages: int) -> list[tuple]:
    if op.forward:
        return [(True, op.micro_batch, op.stage - 1)] if op.stage > 0 else []
    needs = [(True, op.micro_batch, op.stage)]
    return needs + ([(False, op.micro_batch, op.stage + 1)] if op.stage < stages - 1 else [])


def ideal_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of the schedule with equal stages and free communication: the papers' formulas for 1F1B
    and interleaved 1F1B; for DualPipeV (no closed form for DeepSpeed's variant, which keeps the weight
    gradient inside the backward pass) the timed run of its orders with a backward twice a forward."""
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return run_timeline(cached_orders(schedule, p, m), 0.5, 1.0).bubble_fraction()


def peak_in_flight(order: list[PassOp], stage_weight=None) -> float:
    """Most activations a rank holds at once: (micro-batch, stage) passes whose forward ran and whose backward
    has not, each weighing `stage_weight(stage)` (default 1: counted in stage-sized units; a stage is 1/v of
    the rank's layers when interleaved). With the bytes a stage keeps per micro-batch as the weight, the
    peak activation memory of the rank's schedule."""
    weight = stage_weight or (lambda stage: 1)
    held = peak = 0
    for op in order:
        held += weight(op.stage) if op.forward else -weight(op.stage)
        peak = max(peak, held)
    return peak


@lru_cache(maxsize=1024)
def in_flight_front(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple, tuple]:
    """(the stages of rank `rank`'s order, the count vectors — passes in flight per stage — that no other point of
    the order exceeds in every stage). With non-negative stage weights the weighted peak (`peak_in_flight`) is met
    at one of these few vectors, so the planner, which weighs the same order by many rows' bytes, scans them instead
    of the whole order (thousands of passes at m = 512)."""
    order = cached_orders(schedule, p, m, v)[rank]
    stages = tuple(sorted({op.stage for op in order}))
    index = {stage: i for i, stage in enumerate(stages)}
    counts = [0] * len(stages)
    seen = {tuple(counts)}
    for op in order:
        counts[index[op.stage]] += 1 if op.forward else -1
        seen.add(tuple(counts))
    front = [c for c in seen if not any(o != c and all(x >= y for x, y in zip(o, c)) for o in seen)]
    return stages, tuple(sorted(front))


def weighted_peak_in_flight(schedule: str, p: int, m: int, v: int, rank: int, weight: dict) -> float:
    """`peak_in_flight` of the rank's order with `weight[stage]` >= 0 (in_flight_front)."""
    stages, front = in_flight_front(schedule, p, m, v, rank)
    weights = [weight[stage] for stage in stages]
    return max(sum(w * n for w, n in zip(weights, counts)) for counts in front)


@lru_cache(maxsize=64)
def _rounds(p: int, v: int, m: int, forward_only: bool) -> Timeline:
    return run_timeline(schedule_orders("interleaved", p, m, v, forward_only), 1.0, 1.0)


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """DeepSpeed instructions for interleaved 1F1B on one rank (`stage_id`), run by
    `hybrid3d.ds_internals.interleaved_pipeline.InterleavedPipelineEngine`.

    The instructions follow a run of all ranks' orders in unit time: round t holds the pass each rank starts
    at t, the sends of what it produced and the receives of what its neighbours produced in that round, and
    a CommitP2P that posts them. Every rank therefore posts the messages of a pair of ranks in the same
    order (one message per pair and round at most), which is what NCCL's and gloo's point-to-point matching
    needs; a receive is waited for only by the pass that consumes it. Buffer `chunk·m + i` holds micro-batch
    i's tensors on chunk `chunk`; instructions carry the chunk."""

    def __init__(self, micro_batches, stages, stage_id, chunks, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.chunks = chunks
        self.forward_only = forward_only

    def num_pipe_buffers(self):
        return self.chunks * self.micro_batches

    def _buffer(self, op: PassOp) -> int:
        return (op.stage // self.stages) * self.micro_batches + op.micro_batch

    def steps(self):
        p, v, m, rank = self.stages, self.chunks, self.micro_batches, self.stage_id
        timeline = _rounds(p, v, m, self.forward_only)
        last_stage = p * v - 1
        by_round = {}  # round -> [(rank, op)]
        for r, (order, starts) in enumerate(zip(timeline.orders, timeline.starts)):
            for op, start in zip(order, starts):
                by_round.setdefault(int(start), []).append((r, op))
        for t in range(int(timeline.makespan)):
            cmds = []
            for r, op in by_round.get(t, []):
                if r == rank:
                    cmds += self._pass(op, last_stage)
            for r, op in by_round.get(t, []):
                cmds += self._messages(r, op, last_stage)
            if any(isinstance(c, (ds_schedule.SendActivation, ds_schedule.RecvActivation, ds_schedule.SendGrad,
                                  ds_schedule.RecvGrad)) for c in cmds):
                cmds.append(ds_schedule.CommitP2P())
            yield cmds
        if not self.forward_only:
            yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]

    def _pass(self, op: PassOp, last_stage: int) -> list:
        buffer, chunk = self._buffer(op), op.stage // self.stages
        if not op.forward:
            return [ds_schedule.BackwardPass(buffer, chunk=chunk)]
        load = op.stage in (0, last_stage)  # inputs on the first stage, labels on the last
        return ([ds_schedule.LoadMicroBatch(buffer, chunk=chunk)] if load else []) + \
            [ds_schedule.ForwardPass(buffer, chunk=chunk)]

    def _messages(self, sender: int, op: PassOp, last_stage: int) -> list:
        """This rank's side of the message `op` (run by `sender`) produces: the activation for stage s+1 or
        the gradient for stage s-1."""
        p, rank = self.stages, self.stage_id
        if op.forward and op.stage < last_stage:
            to = PassOp(True, op.micro_batch, op.stage + 1)
            send, recv = ds_schedule.SendActivation, ds_schedule.RecvActivation
        elif not op.forward and op.stage > 0:
            to = PassOp(False, op.micro_batch, op.stage - 1)
            send, recv = ds_schedule.SendGrad, ds_schedule.RecvGrad
        else:
            return []
        cmds = []
        if sender == rank:
            cmds.append(send(self._buffer(op), chunk=op.stage // p, peer=to.stage % p))
        if to.stage % p == rank:
            cmds.append(recv(self._buffer(to), chunk=to.stage // p, peer=sender))
        return cmds

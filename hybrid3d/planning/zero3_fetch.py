"""ZeRO-3's parameter fetching, replayed: which partitioned parameters DeepSpeed all-gathers in one micro-batch,
in how many collectives, and how many elements are gathered at once at most (the "live" parameters).

DeepSpeed 0.19's `PartitionedParameterCoordinator` (runtime/zero/partitioned_param_coordinator.py) records the
order in which modules run in the first forward and backward, then for every later micro-batch, at each module:

- fetch: all-gathers the module's parameters that are not available (one coalesced collective);
- prefetch: walks the recorded parameter trace ahead, all-gathering (one more collective) parameters that are not
  available until `stage3_prefetch_bucket_size` elements are in flight, never above `stage3_max_live_parameters`
  available; every parameter it walks past is marked as fetched for its later use;
- release, when the module's forward (backward) ends: frees its gathered parameters except persistent ones
  (<= `stage3_param_persistence_threshold` elements: never partitioned between steps), those the prefetcher marked
  for a later use, and those used again within `stage3_max_reuse_distance` elements of the trace ahead.

So what a micro-batch gathers depends on the model's size against these three knobs: a model smaller than the
prefetch bucket is gathered whole by the first module's prefetch and held through the backward (the walk marks
every parameter for its backward use); a larger one is gathered layer by layer, and layers within the reuse
distance of their backward stay gathered across the forward/backward turn. The replay below follows those rules
over hybrid3d's module structure (`module_tree`), and `tests/distributed/test_zero3_memory.py` checks it
against DeepSpeed's comms logger and the coordinator's own count of available elements.
"""

import collections
import functools
import math
import dataclasses
from dataclasses import dataclass

from hybrid3d.config.auto_values import zero3_knobs
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import lora_factor_shapes, lora_weights
from hybrid3d.planning.parameters import layer_parameter_numels

DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (elements)
DEFAULT_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size (elements)
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters (elements)
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance (elements)




@dataclass(frozen=True)
class Zero3Knobs:
    """DeepSpeed's `zero_optimization.stage3_*` settings the fetching depends on (elements)."""

    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    prefetch_bucket: int = DEFAULT_PREFETCH_BUCKET
    max_live: int = DEFAULT_MAX_LIVE_PARAMETERS
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE

    @classmethod
    def from_zero_config(cls, zero_optimization: dict) -> "Zero3Knobs":
        """The knobs a `zero_optimization` section sets (numbers; the config checks refuse anything else)."""
        return cls(**zero3_knobs(zero_optimization))

    def changed(self) -> dict:
        """The knobs that differ from DeepSpeed's defaults, by field (config.auto_values writes DeepSpeed's keys)."""
        default = Zero3Knobs()
        return {field: value for field, value in dataclasses.asdict(self).items() if value != getattr(default, field)}


@dataclass(frozen=True)
class Module:
    """A module that owns parameters (ids into the numel table) and the modules it runs inside its forward."""

    params: tuple[int, ...]
    children: tuple["Module", ...] = ()


@dataclass(frozen=True)
class MicroBatchFetch:
    """One micro-batch's ZeRO-3 fetching on one rank (elements are whole-parameter counts, `ds_numel`)."""

    gathered: tuple[int, ...]  # ids of the parameters all-gathered, once per gather
    collectives: int  # coalesced all-gathers issued
    peak_available: int  # the most elements available (gathered or in flight) at once, persistent ones excluded


def module_tree(shape: LlamaShape, t: int) -> tuple[list[int], list[bool], Module]:
    """(numel of each parameter on one TP rank, whether it trains, the model's module tree) for a dense model
    without a pipeline, as
    hybrid3d builds it (model/llama.py, layers.py, attention.py, mlp.py), keeping the modules DeepSpeed's hooks
    fire for: the top module runs the embedding, the decoder blocks, the final norm and the head; a block runs its
    input norm, the attention (q/k/v are gathered for it; it runs the q/k norms, the core and o), the
    post-attention norm and the MLP (gate and up; it runs down). A tied head reads the embedding's weight in the
    top module's forward, so that weight belongs to the top module. LoRA adapters (`shape.lora_rank`) are read by
    the module that reads their base weight: A and B of q/k/v by the attention, of gate/up by the MLP, of o and
    down by o and down; only they train, the base is frozen."""
    if shape.is_moe:
        raise ValueError("ZeRO-3 fetching is modelled for dense models only (ZeRO-3 refuses mixture-of-experts)")
    specs = layer_parameter_numels(shape, t)  # the TP plan's sizes, each layer's in registration order
    block = specs[1][1]  # input norm, q/k/v (+ biases), o, (q/k norms), post-attention norm, gate, up, down
    qkv_count = 3 * (1 + shape.qkv_bias)
    qk_norms = block[2 + qkv_count:-4]
    numels: list[int] = []
    trains: list[bool] = []

    def params(*sizes: int, adapter: bool = False) -> tuple[int, ...]:
        numels.extend(sizes)
        trains.extend([adapter or not shape.lora_rank] * len(sizes))
        return tuple(range(len(numels) - len(sizes), len(numels)))

    # A, B sizes beside each base projection on this TP rank (model/tp_plan.py), in HF order
    adapters = {base.split(".")[-2]: [a * b for a, b in lora_factor_shapes(base, shape, t, shape.lora_rank)]
                for _, _, base in lora_weights(shape, shape.lora_targets)} if shape.lora_rank else {}

    def with_adapters(ids: tuple[int, ...], *projections: str) -> tuple[int, ...]:
        return ids + params(*[n for p in projections for n in adapters.get(p, [])], adapter=True)

    tied = shape.tie_word_embeddings
    embedding = params(*specs[0][1])
    blocks = []
    for _ in range(shape.num_layers):
        input_norm = Module(params(block[0]))
        qkv = with_adapters(params(*block[1:1 + qkv_count]), "q_proj", "k_proj", "v_proj")
        norms = tuple(Module(params(n)) for n in qk_norms)
        o = Module(with_adapters(params(block[1 + qkv_count]), "o_proj"))
        attention = Module(qkv, (*norms, Module(()), o))  # ..., the core, o
        post_norm = Module(params(block[-4]))
        down = Module(with_adapters(params(block[-1]), "down_proj"))
        mlp = Module(with_adapters(params(*block[-3:-1]), "gate_proj", "up_proj"), (down,))
        blocks.append(Module((), (input_norm, attention, post_norm, mlp)))
    final_norm = Module(params(*specs[-2][1]))
    head = Module(() if tied else params(*specs[-1][1]))
    top = Module(embedding if tied else (), (Module(() if tied else embedding), *blocks, final_norm, head))
    return numels, trains, top


def _events(module: Module, backward: bool) -> list[tuple[str, Module]]:
    """("fetch" | "release", module) in the order DeepSpeed's hooks fire: a module's fetch, its children's events,
    its release. The backward visits the children in reverse, each parent before the modules inside it."""
    children = module.children[::-1] if backward else module.children
    return [("fetch", module)] + [e for child in children for e in _events(child, backward)] + [("release", module)]


def replay_micro_batch(numels: list[int], top: Module, knobs: Zero3Knobs = Zero3Knobs()) -> MicroBatchFetch:
    """DeepSpeed's coordinator over one micro-batch with a complete trace (every micro-batch after the first), all
    partitioned parameters released when it starts."""
    events = _events(top, backward=False) + _events(top, backward=True)
    order = [m for kind, m in events if kind == "fetch"]  # the recorded module trace
    queue = collections.deque((p, step) for step, m in enumerate(order) for p in sorted(set(m.params)))
    persistent = {p for p, n in enumerate(numels) if n <= knobs.persistence_threshold}
    available = set(persistent)
    marked = collections.defaultdict(lambda: -10**10)  # the step each parameter was last fetched for
    gathered, collectives, n_available, peak = [], 0, 0, 0
    step = 0

    def gather(ids) -> None:
        nonlocal collectives, n_available, peak
        ids = [p for p in ids if p not in available]
        if ids:
            gathered.extend(ids)
            collectives += 1
            available.update(ids)
            n_available += sum(numels[p] for p in ids)
            peak = max(peak, n_available)

    for kind, module in events:
        own = sorted(set(module.params))
        if kind == "fetch":
            gather(own)
            for _ in [p for p in own if marked[p] < step]:  # consumed from the trace
                p, last = queue.popleft()
                marked[p] = last
            if knobs.prefetch_bucket > 0:
                budget, taking, size = min(knobs.max_live - n_available, knobs.prefetch_bucket), [], 0
                while queue and size < budget:
                    p, last = queue.popleft()
                    marked[p] = max(marked[p], last)
                    if p not in available and p not in taking:
                        taking.append(p)
                        size += numels[p]
                gather(taking)
            step += 1
        else:
            release = {p for p in own if p not in persistent and marked[p] <= step}
            traversed = 0
            for later in order[step:]:  # used again within the reuse distance: kept
                if traversed >= knobs.max_reuse_distance:
                    break
                for p in later.params:
                    release.discard(p)
                    traversed += numels[p]
            for p in release & available:
                available.discard(p)
                n_available -= numels[p]
    return MicroBatchFetch(tuple(gathered), collectives, peak)


def partition_numel(numel: int, nd: int) -> int:
    """A parameter's partition on each of nd ranks (DeepSpeed pads every parameter to a multiple of nd)."""
    return math.ceil(numel / nd)


@functools.lru_cache(maxsize=64)  # a memo of a pure function: the planner asks for each layout's rows many times
def replayed(shape: LlamaShape, tp: int,
             knobs: Zero3Knobs = Zero3Knobs()) -> tuple[tuple[int, ...], tuple[bool, ...], MicroBatchFetch]:
    """(parameter sizes on one TP rank, whether each trains, one micro-batch's fetching) of `shape`."""
    numels, trains, top = module_tree(shape, tp)
    return tuple(numels), tuple(trains), replay_micro_batch(numels, top, knobs)


@dataclass(frozen=True)
class Zero3Traffic:
    """One rank's ZeRO-3 data-parallel collectives of one optimizer step, as DeepSpeed's comms logger records them
    (an all-gather by its input, this rank's partitions; a reduce-scatter by its input, the whole gradients)."""

    gather_bytes: int  # the coordinator's all-gathers, every micro-batch, + the persistent parameters' after the step
    gather_calls: int
    reduce_scatter_bytes: int  # every micro-batch's gradients, in the communication dtype
    peak_live_numel: int  # the most elements gathered at once (`MicroBatchFetch.peak_available`)


def zero3_step_traffic(shape: LlamaShape, tp: int, nd: int, gas: int, lp: int,
                       knobs: Zero3Knobs = Zero3Knobs()) -> Zero3Traffic:
    """ZeRO-3's collectives per step for one TP rank partitioned over nd ranks, lp bytes per element (the compute
    dtype, in which DeepSpeed gathers the weights and reduces the gradients). Each micro-batch replays the
    coordinator (`replay_micro_batch`) and reduce-scatters every gradient; after the step the persistent
    parameters, which the step updated in their partitions, are all-gathered one collective each
    (stage3.py's `_post_step`). Over one rank (nd = 1) DeepSpeed gathers nothing. With LoRA only the adapters'
    gradients are reduced."""
    numels, trains, fetch = replayed(shape, tp, knobs)
    persistent = [n for n in numels if n <= knobs.persistence_threshold]
    gathers, calls = 0, 0
    if nd > 1:
        gathers = gas * sum(partition_numel(numels[p], nd) for p in fetch.gathered)
        gathers += sum(partition_numel(n, nd) for n in persistent)
        calls = gas * fetch.collectives + len(persistent)
    reduced = sum(n for n, trains_it in zip(numels, trains) if trains_it)
    return Zero3Traffic(lp * gathers, calls, gas * lp * reduced, fetch.peak_available)

"""Model states of ZeRO-3 and of optimizer/parameter offload, as DeepSpeed 0.19 allocates them, device and host
bytes apart.

ZeRO-3 (Rajbhandari et al. 2020, P_os+g+p; DeepSpeed's `DeepSpeedZeroOptimizer_Stage3`, runtime/zero/stage3.py and
partition_parameters.py). Each of a rank's parameters (one TP shard, no pipeline) is padded to a multiple of Nd
and split: its partition has ⌈n/Nd⌉ elements, and P = Σ⌈n_i/Nd⌉ is the rank's share. At the optimizer step, the
peak of the model states, a rank holds (counted by `ds_internals.memory_probe` from the wrapper's own tensors,
tests/distributed/test_zero3_build.py):

| category     | tensors                                                          | bytes                 |
|--------------|------------------------------------------------------------------|-----------------------|
| params       | the flat buffer of the lp partitions (`fp16_partitioned_groups`)  | lp·P                  |
|              | persistent parameters (n <= stage3_param_persistence_threshold,  | + lp·Σ n_persistent   |
|              | default 1e5: norms, biases) kept whole beside their partition    |                       |
| grads        | `grad_partitions_flat_buffer` (the gradient accumulation dtype)  | ga·P                  |
|              | the reduce bucket (`ipg_buckets`, lp, reduce_bucket_size B)       | + lp·B                |
|              | the fp32 gradient of the master partition (`.grad`)              | + 4·P                 |
| master       | fp32 master partition (`fp32_partitioned_groups_flat`)            | 4·P                   |
| optim_states | Adam's moments (+ torch Adam's 4-byte step tensor)               | 8·P (+ 4)             |

lp = 2 in bf16, 4 in fp32 (the master is a copy in fp32 too, as measured); ga = 4 with
`data_types.grad_accum_dtype: fp32`, else lp. DeepSpeed's default B is 5e8 elements: 1 GB in bf16, 2 GB in fp32,
allocated at start-up whatever the model's size.

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021): `offload_optimizer: cpu` moves the
gradient partition buffer, the fp32 gradient, master and Adam moments to host memory (DeepSpeedCPUAdam, no step
tensor); `offload_param: cpu` (ZeRO-3 only) moves the lp partitions too. What stays on the device: the reduce bucket,
persistent parameters, and the parameters gathered for the layers being computed. With ZeRO-1/2 the optimizer's
fp32 partition, its gradient and the moments go to the host the same way (`offload_states` below).

Gathered ("live") parameters, device only, during the forward and backward: the most elements DeepSpeed's
parameter coordinator holds gathered at once, as `zero3_fetch` replays it (the module running, what the prefetcher
fetched ahead within stage3_prefetch_bucket_size and stage3_max_live_parameters, and what stays gathered because
it is used again within stage3_max_reuse_distance): `live_parameter_bytes`. The probe's snapshots do not see them
(they are freed as their modules finish); tests/distributed/test_zero3_memory.py checks the replay against the
coordinator's own count.
"""

import math
from dataclasses import dataclass

from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.memory import (
    ModelStates,
    RankModelStates,
    aligned_numel,
    compute_bytes,
    params_in_partition,
)
from hybrid3d.planning.zero3_fetch import DEFAULT_PERSISTENCE_THRESHOLD, Zero3Knobs, replayed

ZERO3 = "DeepSpeedZeroOptimizer_Stage3"
OFFLOAD_CHOICES = ("none", "optimizer", "optimizer+params")  # the planner's `offload` column


@dataclass(frozen=True)
class PlacedStates:
    """A rank's model states at their peak, with the part held in host memory."""

    states: RankModelStates  # device and host together, the probe's categories
    host: ModelStates  # the offloaded part at the step
    host_boundary: ModelStates  # and at the accumulation boundary

    @property
    def device_bytes(self) -> int:
        """The larger of the two moments on the device."""
        return max(self.states.boundary.total - self.host_boundary.total, self.states.step.total - self.host.total)

    @property
    def host_bytes(self) -> int:
        return max(self.host.total, self.host_boundary.total)


def zero3_partition_numel(numels: list[int], nd: int) -> int:
    """P: the elements of a rank's partitions, each parameter padded to a multiple of nd (`_aligned_size`)."""
    return sum(math.ceil(n / nd) for n in numels)


def zero3_model_states(numels: list[int], nd: int, precision: str, reduce_bucket_size: int,
                       persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD, offload: str = "none",
                       torch_adam: bool = True, gathered_numel: int = 0) -> PlacedStates:
    """ZeRO-3 model states of a rank holding parameters of sizes `numels` (its TP shard), partitioned over nd
    ranks (the module table); `offload` one of OFFLOAD_CHOICES; `torch_adam`: torch's Adam keeps a step tensor
    (DeepSpeedCPUAdam, which offload uses, does not); `gathered_numel`: the elements of the first layer on this TP
    rank, gathered at the accumulation boundary. Host buffers exist at the step (the fp32 gradient is made for it)."""
    lp = compute_bytes(precision)
    ga = 4 if precision == "bf16+fp32acc" else lp
    part = zero3_partition_numel(numels, nd)
    persistent = sum(n for n in numels if n <= persistence_threshold)
    adam = 8 * part + (4 if torch_adam and offload == "none" else 0)
    # persistent parameters are whole between the steps (the step partitions them and gathers them after its
    # update); when the gradient reduction starts the first layer (the embedding, the backward's last module) is still
    # gathered; the fp32 gradient exists only for the step, with offload it is a host buffer held from the first
    # reduction into it on (measured: there at the boundary with buckets smaller than the model, not yet with one
    # bucket for all of it: an upper bound then)
    fp32_grad = 4 * part if offload != "none" else 0
    boundary = ModelStates(params=lp * (part + persistent + gathered_numel),
                           grads=ga * part + lp * reduce_bucket_size + fp32_grad, master=4 * part, optim_states=adam)
    step = ModelStates(params=lp * part, grads=ga * part + lp * reduce_bucket_size + 4 * part, master=4 * part,
                       optim_states=adam)
    host = host_boundary = ModelStates(0, 0, 0, 0)
    if offload != "none":
        host = host_boundary = ModelStates(params=lp * part if offload == "optimizer+params" else 0,
                                           grads=ga * part + 4 * part, master=4 * part, optim_states=adam)
    return PlacedStates(RankModelStates(boundary, step, ZERO3), host, host_boundary)


def lora_zero3_model_states(base_numels: list[int], adapter_numels: list[int], nd: int, precision: str,
                            reduce_bucket_size: int, persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
                            gathered_numel: int = 0) -> PlacedStates:
    """LoRA under ZeRO-3: the adapters' ZeRO-3 model states (only they reach DeepSpeed's optimizer,
    `zero3_model_states`) and the frozen base, partitioned by `zero.Init` like every parameter: its lp partitions,
    and persistent tensors whole beside them; no gradient, master or optimizer state. No offload."""
    placed = zero3_model_states(adapter_numels, nd, precision, reduce_bucket_size, persistence_threshold,
                                gathered_numel=gathered_numel)
    frozen = compute_bytes(precision) * (zero3_partition_numel(base_numels, nd)
                                         + sum(n for n in base_numels if n <= persistence_threshold))

    def plus_base(s: ModelStates) -> ModelStates:
        return ModelStates(s.params + frozen, s.grads, s.master, s.optim_states)

    states = placed.states
    return PlacedStates(RankModelStates(plus_base(states.boundary), plus_base(states.step), states.wrapper),
                        placed.host, placed.host_boundary)


def offload_states(states: RankModelStates, numels: list[int], nd: int, zero: int, precision: str, dp_rank: int = 0,
                   gas: int = 1, reduce_bucket_size: int = 500_000_000) -> PlacedStates:
    """ZeRO-1/2 `states` (`memory.model_states_from_numels`) with `offload_optimizer: cpu` (stage_1_and_2.py's
    cpu_offload). In host memory: the fp32 partition of aligned(Ψ)/Nd elements, its fp32 gradient and Adam's moments
    (DeepSpeedCPUAdam: no step tensor), an lp copy of the partition for the updated weights' way back, an lp staging
    buffer of the largest parameter, and at ZeRO-2 with gas > 1 an lp accumulator of every parameter overlapping the
    rank's partition; on the device, besides the lp weights, their gradients and the reduce bucket, an lp staging buffer of
    the largest parameter. `reduce_bucket_size` (elements) decides what ZeRO-2 holds at the accumulation boundary."""
    lp = compute_bytes(precision)
    part = aligned_numel(sum(numels), nd) // nd
    largest = lp * max(numels)
    # ZeRO-2 (partitioned gradients) accumulates on the host between micro-batches; ZeRO-1 reduces at the boundary
    mine = params_in_partition(numels, part, dp_rank)
    accumulators = lp * sum(numels[i] for i in mine) if gas > 1 and zero == 2 else 0
    host = ModelStates(params=lp * part, grads=4 * part + largest + accumulators, master=4 * part,
                       optim_states=8 * part)

    def offloaded(s: ModelStates, fp32_grad: int, accumulated: int) -> ModelStates:
        return ModelStates(s.params + lp * part, s.grads + fp32_grad + 2 * largest + accumulated, s.master, 8 * part)

    # At the accumulation boundary ZeRO-2 with gas > 1 holds the host accumulators or the fp32 gradient, as its
    # buckets were reduced (measured, tests/distributed/test_zero3_memory.py and benchmarks/zero_compare.py: with the
    # rank's gradients in several buckets the accumulators, up to a norm's, and not the fp32 gradient, with one bucket
    # the reverse); ZeRO-1 and gas 1 hold the fp32 gradient. The step's states already count the fp32 gradient.
    fp32_grad, held = 4 * part, accumulators
    if accumulators:
        one_bucket = reduce_bucket_size >= sum(numels)
        fp32_grad, held = (4 * part, 0) if one_bucket else (0, accumulators)

    placed = RankModelStates(offloaded(states.boundary, fp32_grad, held), offloaded(states.step, 0, accumulators),
                             states.wrapper)
    host_boundary = ModelStates(host.params, fp32_grad + largest + held, host.master, host.optim_states)
    return PlacedStates(placed, host, host_boundary)


def live_parameter_bytes(shape: LlamaShape, tp: int, precision: str, knobs: Zero3Knobs = Zero3Knobs()) -> int:
    """Device bytes of the parameters ZeRO-3 holds gathered at most during a micro-batch on one TP rank (module
    docstring; persistent parameters are counted with the model states)."""
    return compute_bytes(precision) * replayed(shape, tp, knobs)[2].peak_available

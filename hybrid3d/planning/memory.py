"""Analytic per-rank memory: model states (ZeRO stages as DeepSpeed 0.19 implements them) and activations.

Letters: Ψ parameters (on this rank), Nd data-parallel degree, K optimizer bytes per parameter,
b micro-batch, s sequence, h hidden, a heads, f intermediate (SwiGLU), V vocabulary, L layers,
t tensor-parallel degree, p pipeline stages, m micro-batches per step (GAS), B reduce_bucket_size,
c context-parallel degree.

Model states — ZeRO paper (Rajbhandari et al. 2020, §5, Fig. 1) with mixed precision and Adam (K = 12):
    DP: (2 + 2 + K)·Ψ      ZeRO-1 (P_os): 4Ψ + K·Ψ/Nd      ZeRO-2 (P_os+g): 2Ψ + (2 + K)·Ψ/Nd
`zero_paper_bytes` is that accounting. `rank_model_states` is what DeepSpeed 0.19 really allocates,
read from its optimizer wrappers and confirmed by counting their tensors (`hybrid3d.memory_probe`):

| precision, ZeRO             | wrapper                 | at the accumulation boundary             | at the step       |
|-----------------------------|-------------------------|------------------------------------------|-------------------|
| fp32, 0                     | (torch optimizer)       | 4Ψ params + 4Ψ grads + 8Ψ Adam           | same              |
| bf16, 0, p = 1              | FP16_UnfusedOptimizer   | 2Ψ + 2Ψ grads + 4Ψ master + 8Ψ Adam      | + 4Ψ fp32 grads   |
| bf16, 0, p > 1              | BF16_Optimizer          | 2Ψ + 2Ψ lp grads + 2Ψ buffer + 12Ψ/Nd    | + 4Ψ/Nd fp32 grads|
| bf16 + fp32 accum, 1        | BF16_Optimizer          | 2Ψ + 2Ψ lp grads + 4Ψ buffer + 12Ψ/Nd    | same              |
| bf16 or fp32 (x bytes), 1   | DeepSpeedZeroOptimizer  | xΨ + xΨ grads + xB bucket + 12Ψ/Nd       | xΨ + 16Ψ/Nd       |
| bf16 or fp32 (x bytes), 2   | DeepSpeedZeroOptimizer  | xΨ + x·(G + G if m > 1) + xB + 12Ψ/Nd    | xΨ + 16Ψ/Nd       |
| bf16 + fp32 accum, 2        | DeepSpeedZeroOptimizer  | 2Ψ + 4Ψ/Nd partition + 2B + 12Ψ/Nd       | 2Ψ + 16Ψ/Nd       |
| same, p > 1 (pipeline_zero2)| DeepSpeedZeroOptimizer  | 2Ψ + 4Ψ/Nd + 2B + 2T + 4Ψ_def + 12Ψ/Nd   | 2Ψ + 16Ψ/Nd       |

BF16_Optimizer keeps the bf16 `.grad` of every parameter besides its flat accumulation buffer
(it zeroes them rather than freeing them), hence 2Ψ more than the 2Ψ + 4Ψ + 12Ψ/Nd often quoted.
G is the number of elements of the whole parameters that overlap this rank's partition (ZeRO-2
sizes `grads_in_partition` by whole parameters), so it depends on the DP rank; the buffer exists
only once a bucket holding one of them has been reduced, and a parameter larger than B bypasses
the bucket and keeps its `.grad` until the next reduction: `zero2_gradients.zero2_boundary_grads` replays the
bucketing. Flat buffers are padded to a multiple of 2·Nd elements (`nccl_start_alignment_factor`);
padding is counted.
`hybrid3d.pipeline_zero2` (ZeRO-2 inside the 1F1B pipeline) is counted at its worst moment, a bucket
reduction in the last backward or in the release of the Ψ_def deferred elements
(`pipeline_zero2_deferred_fraction`, fp32 accumulators): T gradient elements are outside the bucket
then (`zero2_gradients.pipeline_zero2_grads` replays the bucketing).
Adam's `step` counters are 4 bytes per tensor. All figures are per rank: Ψ is the parameter
count of one TP rank of one pipeline rank (`rank_parameter_numels`): its stage with 1F1B, its v stages
r + k·p with the interleaved schedule (as many blocks as 1F1B's stage r, v·p dividing L; embedding on rank
0, head on rank p-1), stages r and 2p-1-r with DualPipeV (rank 0 holds the embedding and the head, one
module when tied).

With context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) the c ranks of a CP group hold the
same parameters (one TP shard of one stage), and ZeRO partitions over DeepSpeed's data-parallel group,
which holds the CP ranks too (`parallel/layout.py`; the gradients are reduced over it) of d·c ranks: Nd = d·c in every
formula above, and callers pass nd = dp = d·c (the planner does). Ψ does not depend on c; sequence
parallelism changes neither Ψ nor Nd.

LoRA (Hu et al. 2021; `shape.lora_rank` r > 0, adapters beside `shape.lora_targets`, `model/tp_plan.py`): only the
adapters A (r x in) and B (out x r) are trained, so the table above applies to Ψ_A, the adapter elements of the rank
(`rank_adapter_numels`: the TP plan's `lora_factor_shapes` over the rank's decoder blocks), and the frozen base
(every weight of the rank, `rank_parameter_numels`: blocks, embedding, norms, head) adds x bytes per element in the
compute dtype, x = 4 for fp32, else 2 (`compute_bytes`): no gradient, no fp32 master, no Adam state, and not
partitioned by ZeRO (stages 1 and 2 never partition parameters). Model states = x·Ψ_base + states(Ψ_A), in
`params` (`lora_model_states`). The trainer hands DeepSpeed the trainable parameters only
(`training/trainer.py`), so its wrappers see Ψ_A alone. Refused as `config.support.check_lora` refuses the run:
a mixture-of-experts model, pipeline_zero2.

Activations: `hybrid3d.planning.activations` (Korthikanti et al. 2022, with SP and CP: Ulysses, ring attention or
both), re-exported here. With
LoRA they are counted as without: the frozen base still saves what its backward needs for the activation
gradients, and the adapters' r-dimensional intermediates (A x, b·s·r elements per target) are ignored, below
r/h of a layer's activations.
"""

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from hybrid3d.config.support import check_lora
from hybrid3d.ds_internals import TIED_SUM_CHUNK_ELEMENTS
from hybrid3d.ds_internals.pipeline_zero2 import deferred_indices
from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.tensor_parallel.layers import padded_vocab_size
from hybrid3d.planning.activations import (  # noqa: F401 (re-exported: the memory model's public names)
    activation_bytes,
    activation_bytes_per_layer,
    in_flight_micro_batches,
    output_layer_activation_bytes,
    rank_stages,
    stage_layer_count,
)
from hybrid3d.planning.parameters import (  # noqa: F401 (re-exported: the memory model's public names)
    adapter_parameters,
    block_adapter_numels,
    layer_parameter_numels,
    model_parameters,
    rank_adapter_numels,
    rank_expert_numels,
    rank_parameter_numels,
    stage_parameter_numels,
)
from hybrid3d.planning.zero2_gradients import params_in_partition, pipeline_zero2_grads, zero2_boundary_grads

PRECISIONS = ("fp32", "bf16", "bf16+fp32acc")
TORCH, UNFUSED, BF16_OPT, ZERO_OPT = "torch", "FP16_UnfusedOptimizer", "BF16_Optimizer", "DeepSpeedZeroOptimizer"
ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: flat buffers are padded to 2·Nd elements
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
GB = 1e9


def zero_paper_bytes(psi: float, nd: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device in the ZeRO paper's accounting (Rajbhandari et al. 2020, §5.1):
    2Ψ fp16 params, 2Ψ fp16 grads, KΨ optimizer states (K = 12 for mixed-precision Adam)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    if stage == 3:
        return (2 + 2 + k) * psi / nd
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")


# ---------------------------------------------------------------- parameters per rank


def optimizer_wrapper(zero: int, precision: str, pp: int) -> str:
    """The wrapper DeepSpeed 0.19's engine picks (`runtime/engine.py: _configure_optimizer`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if zero not in (0, 1, 2):
        raise ValueError(f"ZeRO stage must be 0, 1 or 2, got {zero}")
    if precision == "fp32":
        return TORCH if zero == 0 else ZERO_OPT
    if precision == "bf16":
        if zero == 0:
            return BF16_OPT if pp > 1 else UNFUSED
        return ZERO_OPT
    if zero == 0:
        raise ValueError("bf16 with grad_accum_dtype fp32 needs ZeRO stage >= 1")
    return BF16_OPT if zero == 1 else ZERO_OPT


@dataclass(frozen=True)
class ModelStates:
    """Bytes per category on one rank (the categories of `hybrid3d.memory_probe`)."""

    params: int
    grads: int
    master: int
    optim_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optim_states


@dataclass(frozen=True)
class RankModelStates:
    boundary: ModelStates  # after the last micro-batch's backward, before the DP reduction
    step: ModelStates  # when the base optimizer's step starts
    wrapper: str

    @property
    def peak(self) -> ModelStates:
        return max((self.boundary, self.step), key=lambda s: s.total)


def compute_bytes(precision: str) -> int:
    """Bytes of a parameter in the compute dtype: 4 for fp32, 2 for bf16 (with either gradient accumulation)."""
    return 4 if precision == "fp32" else 2


def lora_model_states(adapters: RankModelStates, frozen_numel: int, precision: str) -> RankModelStates:
    """A LoRA rank's model states: those of its adapters (`model_states_from_numels` on the adapter sizes) plus its
    `frozen_numel` frozen base elements in the compute dtype, counted as params (no gradient, master or optimizer
    state, not partitioned by ZeRO)."""
    frozen = compute_bytes(precision) * frozen_numel

    def plus_base(states: ModelStates) -> ModelStates:
        return ModelStates(states.params + frozen, states.grads, states.master, states.optim_states)

    return RankModelStates(plus_base(adapters.boundary), plus_base(adapters.step), adapters.wrapper)


def aligned_numel(psi: int, nd: int) -> int:
    """Ψ rounded up to DeepSpeed's flat-buffer alignment of 2·Nd elements."""
    unit = ALIGNMENT_FACTOR * nd
    return math.ceil(psi / unit) * unit


def model_states_from_numels(numels: list[int], nd: int, zero: int, precision: str, pp: int, dp_rank: int = 0,
                             gas: int = 1, reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET,
                             pipeline_zero2: bool = False, deferred_fraction: float = 0.0,
                             tied_numel: int = 0) -> RankModelStates:
    """Model-state bytes of one rank holding parameters of sizes `numels` (see the module table);
    `pipeline_zero2`: ZeRO-2 with pp > 1 through `hybrid3d.pipeline_zero2` (bf16 + fp32 accumulation), where a
    rank holding a copy of a tied weight (`tied_numel` elements) also sums its gradient across stages after the
    last backward, in fp32 chunks of min(B, `TIED_SUM_CHUNK_ELEMENTS`, the weight) elements."""
    wrapper = optimizer_wrapper(zero, precision, pp)
    psi, k = sum(numels), len(numels)
    lp = compute_bytes(precision)
    psi_a = aligned_numel(psi, nd)
    part = psi_a // nd
    adam = 8 * part + 4  # exp_avg + exp_avg_sq of the flat fp32 partition, one step counter
    bucket = lp * reduce_bucket_size
    if wrapper == TORCH:
        states = ModelStates(params=4 * psi, grads=4 * psi, master=0, optim_states=8 * psi + 4 * k)
        return RankModelStates(states, states, wrapper)
    if wrapper == UNFUSED:
        boundary = ModelStates(params=2 * psi, grads=2 * psi, master=4 * psi, optim_states=8 * psi + 4 * k)
        return RankModelStates(boundary, ModelStates(2 * psi, 2 * psi + 4 * psi, 4 * psi, 8 * psi + 4 * k), wrapper)
    if wrapper == BF16_OPT:
        accum = 4 if precision == "bf16+fp32acc" else 2
        boundary = ModelStates(params=2 * psi_a, grads=2 * psi + accum * psi_a, master=4 * part, optim_states=adam)
        fp32_copy = 0 if accum == 4 else 4 * part  # the partition's gradient cast to fp32 for the step
        step = ModelStates(boundary.params, boundary.grads + fp32_copy, boundary.master, adam)
        return RankModelStates(boundary, step, wrapper)
    step = ModelStates(params=lp * psi_a, grads=4 * part, master=4 * part, optim_states=adam)
    if zero == 1:
        grads = lp * psi + bucket
    elif precision == "bf16+fp32acc" and pipeline_zero2:
        deferred = set(deferred_indices(numels, deferred_fraction))
        mine = params_in_partition(numels, part, dp_rank)
        grads = pipeline_zero2_grads(numels, deferred, mine, reduce_bucket_size, part, gas)
        if tied_numel:  # the cross-stage sum, before the deferred gradients are released
            accumulators = 4 * sum(numels[i] for i in deferred) if gas > 1 else 0
            chunk = min(reduce_bucket_size, TIED_SUM_CHUNK_ELEMENTS, tied_numel)
            grads = max(grads, 4 * part + accumulators + 4 * chunk)
    elif precision == "bf16+fp32acc":
        grads = 4 * part + bucket
    else:
        grads = bucket + zero2_boundary_grads(numels, part, dp_rank, reduce_bucket_size, gas) * lp
    return RankModelStates(ModelStates(lp * psi_a, grads, 4 * part, adam), step, wrapper)


def rank_model_states(shape: LlamaShape, tp: int, pp: int, dp: int, zero: int, precision: str, stage: int = 0,
                      dp_rank: int = 0, gas: int = 1, reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET,
                      pipeline_zero2: bool = False, deferred_fraction: float = 0.0, schedule: str = "1f1b",
                      virtual: int = 1, ep: int = 1) -> RankModelStates:
    """Model-state bytes of the rank at (`stage`, `dp_rank`) of layout tp x pp x dp; with context
    parallelism pass dp = d·c (ZeRO partitions over the d·c data-parallel ranks) and a dp_rank in it.
    With `schedule` "interleaved" (`virtual` chunks per rank) or "dualpipev" `stage` is the pipeline rank,
    which holds several stages (`rank_parameter_numels`).
    With LoRA (`shape.lora_rank` > 0) the accounting applies to the rank's adapters and the frozen base adds its
    compute-dtype bytes (`lora_model_states`; LoRA on a mixture-of-experts shape or with `pipeline_zero2` raises
    ConfigError). A mixture-of-experts model (`ep` expert-parallel ranks, e | dp): `moe_model_states`."""
    numels = rank_parameter_numels(shape, tp, pp, stage, schedule, virtual, ep)
    if shape.lora_rank:
        check_lora(shape.is_moe, pipeline_zero2)
        adapters = model_states_from_numels(rank_adapter_numels(shape, tp, pp, stage, schedule, virtual), dp, zero,
                                            precision, pp, dp_rank, gas, reduce_bucket_size)
        return lora_model_states(adapters, sum(numels), precision)
    if shape.is_moe:
        return moe_model_states(numels, rank_expert_numels(shape, tp, pp, stage, schedule, virtual, ep), dp, ep,
                                zero, precision, pp, dp_rank, gas, reduce_bucket_size)
    holds_tied = shape.tie_word_embeddings and pp > 1 and stage in (0, pp - 1)  # 1F1B: pipeline_zero2's schedule
    tied = padded_vocab_size(shape.vocab_size, tp, shape.vocab_pad_multiple) // tp * shape.hidden_size
    return model_states_from_numels(numels, dp, zero, precision, pp, dp_rank, gas, reduce_bucket_size,
                                    pipeline_zero2, deferred_fraction, tied if holds_tied else 0)


def moe_model_states(numels: list[int], expert_numels: list[int], dp: int, ep: int, zero: int, precision: str,
                     pp: int, dp_rank: int = 0, gas: int = 1,
                     reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET) -> RankModelStates:
    """A mixture-of-experts rank: DeepSpeed's optimizers keep two parameter groups
    (`split_params_into_different_moe_groups_for_optimizer`), the dense tensors partitioned over the dp ranks and
    the routed experts (`expert_numels`, a sub-multiset of `numels`) over the dp/e ranks of their
    expert-data-parallel group, each with its own flat buffers, padding and step counter; the gradient bucket is
    one for both (counted once)."""
    experts, dense = Counter(expert_numels), []
    for numel in numels:  # numels less the experts' sizes, each taken at its first occurrence
        if experts[numel]:
            experts[numel] -= 1
        else:
            dense.append(numel)
    groups = [model_states_from_numels(dense, dp, zero, precision, pp, dp_rank, gas, reduce_bucket_size)]
    if not expert_numels:
        return groups[0]
    # EP groups are runs of e consecutive data-parallel ranks, an expert-data-parallel group one rank of each run
    groups.append(model_states_from_numels(expert_numels, dp // ep, zero, precision, pp, dp_rank // ep, gas,
                                           reduce_bucket_size))
    wrapper = groups[0].wrapper
    # DeepSpeedZeroOptimizer's one reduction bucket (lp·B in each group's boundary gradients above)
    shared_bucket = compute_bytes(precision) * reduce_bucket_size if wrapper == ZERO_OPT else 0
    boundary = _sum_states([g.boundary for g in groups], shared_bucket)
    if wrapper != ZERO_OPT:
        return RankModelStates(boundary, _sum_states([g.step for g in groups], 0), wrapper)
    # DeepSpeedZeroOptimizer.step steps its groups one at a time, dense first: while group i steps with its fp32
    # gradient partition, the groups after it still hold their reduced gradients and the groups before it none
    lp = compute_bytes(precision)
    if precision != "bf16+fp32acc":
        # The reduced gradients of the parameters overlapping each group's partition share one storage
        # (ZeRO-2: `grads_in_partition`; ZeRO-1 the same, measured), freed only once the last group's are
        whole = [sum(n[i] for i in params_in_partition(n, g.step.master // 4, r))
                 for n, g, r in ((dense, groups[0], dp_rank), (expert_numels, groups[1], dp_rank // ep))]
        pending = [lp * sum(whole), 0]
    else:  # fp32 accumulation: each group's own partitions, less the emptied bucket
        pending = [groups[1].boundary.grads - lp * reduce_bucket_size, 0]
    steps = [ModelStates(boundary.params, g.step.grads + held, boundary.master, boundary.optim_states)
             for g, held in zip(groups, pending)]
    return RankModelStates(boundary, max(steps, key=lambda states: states.total), wrapper)


def _sum_states(states: list[ModelStates], shared: int) -> ModelStates:
    """Bytes of several parameter groups together, `shared` gradient bytes counted in each once."""
    return ModelStates(sum(s.params for s in states), sum(s.grads for s in states) - shared * (len(states) - 1),
                       sum(s.master for s in states), sum(s.optim_states for s in states))


@lru_cache(maxsize=4096)
def _peak_states(shape: LlamaShape, tp: int, pp: int, nd: int, zero: int, precision: str, rank: int, gas: int,
                 bucket: int, pipeline_zero2: bool, schedule: str, v: int, ep: int = 1) -> int:
    """Peak model-state bytes of pipeline rank `rank` over the ZeRO group of nd ranks: its first DP rank and,
    with ZeRO-2 (whose gradient partition G depends on the DP rank), its last."""
    dp_ranks = {0, nd - 1} if zero == 2 else {0}
    return max(rank_model_states(shape, tp, pp, nd, zero, precision, rank, r, gas, bucket, pipeline_zero2,
                                 schedule=schedule, virtual=v, ep=ep).peak.total for r in dp_ranks)


def worst_rank_bytes(shape: LlamaShape, tp: int, pp: int, nd: int, zero: int, precision: str, checkpointing: bool,
                     b: int, s: int, gas: int, bucket: int = DEFAULT_REDUCE_BUCKET, sp: bool = False, cp: int = 1,
                     pipeline_zero2: bool = False, schedule: str = "1f1b", v: int = 1, comm: str = "a2a",
                     cp_a2a: int = 1, ep: int = 1) -> tuple[float, float]:
    """(model states, activations) bytes of the pipeline rank whose sum is the largest, ZeRO over nd = d·c
    ranks, the rank's stages and in-flight passes those of `schedule` (v chunks per rank when interleaved), CP's
    attention by `comm` (context_parallel_comm; `cp_a2a` its context_parallel_a2a_size with "a2a+p2p"), E/`ep`
    experts per MoE block."""
    states = acts = 0.0
    for rank in range(pp):
        rank_states = _peak_states(shape, tp, pp, nd, zero, precision, rank, gas, bucket, pipeline_zero2, schedule, v,
                                   ep)
        rank_acts = activation_bytes(shape, b, s, tp, pp, rank, gas, checkpointing=checkpointing,
                                     sequence_parallel=sp, cp=cp, schedule=schedule, virtual=v, comm=comm,
                                     cp_a2a=cp_a2a, lp=compute_bytes(precision))
        if rank_states + rank_acts > states + acts:
            states, acts = rank_states, rank_acts
    return states, acts

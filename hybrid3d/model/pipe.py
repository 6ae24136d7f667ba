"""The Llama as DeepSpeed `PipelineModule` layer specs.

Layer i of the spec list is layer i of `LlamaSequential`, so parameter names (`<i>.<name>`)
agree between the pipeline and the single-stage model. With tied embeddings the embedding and
the LM head are one `TiedLayerSpec`: the first and the last stage each hold a copy, DeepSpeed
broadcasts it at start-up and all-reduces its gradient between the two stages every step.
"""

import functools
from functools import lru_cache

from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced

from hybrid3d.ds_internals.interleaved_pipeline import InterleavedPipelineModule
from hybrid3d.ds_internals.pipeline_bounds import with_stage_bounds
from hybrid3d.errors import LayoutError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.flop_counts import block_matmul_parameters, head_matmul_parameters
from hybrid3d.model.hf_weights import TIED_KEY
from hybrid3d.model.layers import DecoderBlock, Embedding, layer_classes, layer_kwargs, seed_layer, tied_lm_logits
from hybrid3d.model.llama import LanguageModelLoss
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.pipeline_schedules import num_stages
from hybrid3d.parallel.rank_groups import ContextParallelGroup, ExpertParallelGroup, TensorParallelGroup

# Balance decoder blocks across stages; the embedding joins the first stage and the final norm
# and head join the last one (DeepSpeed's `type:` partitioning counts only matching layers).
BLOCK_COUNT_PARTITION_METHOD = f"type:{DecoderBlock.__name__}"
# Balance the layers' training FLOPs, the head's included (`layer_costs`): Megatron's
# --account-for-loss-in-pipeline-split, by cost rather than by counting the head as a layer.
COST_PARTITION_METHOD = "cost"
# hybrid3d.partition_method's values: DeepSpeed's own "parameters" and "uniform" too
PARTITION_METHODS = (BLOCK_COUNT_PARTITION_METHOD, COST_PARTITION_METHOD, "parameters", "uniform")
# hybrid3d.partition_method unset. Stages cut by training FLOPs took 0.91-0.96x the step time of count-balanced ones
# at PP2 and 0.92-1.01x at PP4 (benchmarks/results/2026-12-04-vm/stage_balance.md); checkpoints of count-balanced
# runs record their method and bounds (checkpoint/resume.py keeps or reshards them).
DEFAULT_PARTITION_METHOD = COST_PARTITION_METHOD
# The methods whose bounds `stage_bounds` gives, so the memory model, the planner and the checkpoint record
# know them; DeepSpeed's own "parameters" and "uniform" run too, unmodelled (config/ds_checks.py).
MODELLED_PARTITION_METHODS = (BLOCK_COUNT_PARTITION_METHOD, COST_PARTITION_METHOD)


def layer_costs(shape: LlamaShape) -> tuple[int, ...]:
    """Training FLOPs per token of each layer spec, [embedding, L blocks, final norm, head] (a tied head is a
    second embedding spec): 6 x the weights it multiplies (`flop_counts`; forward 2, backward 4), 0 for the
    embedding lookup and the norm; a MoE model's dense and MoE blocks weigh apart. Left out: attention's scores (12·h·s per block, the same for every block, so
    they only lower the head's share at long sequences) and the loss's softmax over V (memory-bound, so it
    raises the head's real share): bounds that depend on the model only, not on the run's sequence length."""
    blocks = tuple(6 * block_matmul_parameters(shape, block) for block in range(shape.num_layers))
    return (0,) + blocks + (0, 6 * head_matmul_parameters(shape))


@lru_cache(maxsize=256)
def stage_bounds(shape: LlamaShape, stages: int, method: str = DEFAULT_PARTITION_METHOD) -> tuple[int, ...]:
    """Layer-spec index bounds per stage: stage s holds specs [bounds[s], bounds[s + 1]) of the L + 3 specs.
    BLOCK_COUNT_PARTITION_METHOD: decoder blocks balanced by count, from DeepSpeed's own solver (as PipelineModule
    runs it); COST_PARTITION_METHOD (the default): `layer_costs` balanced, every stage with at least one decoder
    block (`balanced_bounds`)."""
    if method == BLOCK_COUNT_PARTITION_METHOD:
        return block_count_bounds(shape.num_layers, stages)
    if method == COST_PARTITION_METHOD:
        return balanced_bounds(layer_costs(shape), stages)
    raise ValueError(f"partition method {method!r} has no modelled bounds (one of {MODELLED_PARTITION_METHODS})")


def run_stage_bounds(shape: LlamaShape, pp: int, schedule: str, virtual: int, method: str) -> tuple[int, ...] | None:
    """`stage_bounds` of every stage a pipeline run cuts (the schedule's `num_stages`: v·p interleaved, 2p
    DualPipeV), as its checkpoints record them; None without a pipeline or for a method it does not model."""
    if pp == 1 or method not in MODELLED_PARTITION_METHODS:
        return None
    return stage_bounds(shape, num_stages(schedule, pp, virtual), method)


@lru_cache(maxsize=256)
def block_count_bounds(num_layers: int, stages: int) -> tuple[int, ...]:
    """DeepSpeed's `type:DecoderBlock` bounds: weights 1 per block, 0 for the embedding, norm and head."""
    weights = [0] + [1] * num_layers + [0, 0]
    return tuple(int(x) for x in partition_balanced(weights=weights, num_parts=stages))


def balanced_bounds(costs: tuple[int, ...], stages: int) -> tuple[int, ...]:
    """Contiguous bounds over specs [embedding, blocks..., norm, head] minimising the costliest stage, each
    stage holding at least one decoder block (specs 1..L), ties to the earliest cut: dynamic programming over
    (stages, last spec), O(stages · n²) for n specs."""
    n, blocks = len(costs), len(costs) - 3
    if not 1 <= stages <= blocks:
        raise LayoutError(f"{stages} pipeline stages need as many decoder blocks; the model has {blocks}")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: the least bottleneck cutting specs [0, i) into k stages; cut[k][i]: where the k-th stage starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                if not _holds_a_block(j, i, blocks) or best[k - 1][j] == inf:
                    continue
                bottleneck = max(best[k - 1][j], prefix[i] - prefix[j])
                if bottleneck < best[k][i]:
                    best[k][i], cut[k][i] = bottleneck, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def _holds_a_block(start: int, stop: int, blocks: int) -> bool:
    """Whether specs [start, stop) include one of the decoder blocks 1..blocks."""
    return max(start, 1) < min(stop, blocks + 1)


def check_schedule_stages(shape: LlamaShape, pp: int, schedule: str, virtual: int = 1) -> None:
    """DualPipeV cuts the model into 2p stages (rank r holds stages r and 2p-1-r): each needs a decoder block.
    The interleaved schedule cuts it into v·p equal stages (Megatron's rule: v divides each rank's L/p layers)."""
    if schedule == "dualpipev" and shape.num_layers < 2 * pp:
        raise LayoutError(f"pipeline_schedule 'dualpipev' cuts the model into 2 * pipeline_parallel_size = {2 * pp} "
                          f"stages, more than num_hidden_layers ({shape.num_layers})")
    if schedule == "interleaved" and shape.num_layers % (pp * virtual):
        raise LayoutError(f"virtual_pipeline_size {virtual} must divide the {shape.num_layers}/{pp} decoder layers of "
                          f"each pipeline stage (num_hidden_layers divisible by pipeline_parallel_size * "
                          f"virtual_pipeline_size = {pp * virtual})")


def pipeline_layer_specs(shape: LlamaShape, tp: TensorParallelGroup, cp: ContextParallelGroup | None = None,
                         ep: ExpertParallelGroup | None = None) -> list:
    specs = []
    classes = layer_classes(shape)
    for index, cls in enumerate(classes):
        if index == 0 and shape.tie_word_embeddings:
            specs.append(TiedLayerSpec(TIED_KEY, Embedding, shape, tp, tied_weight_attr=["weight"]))
        else:
            specs.append(LayerSpec(cls, shape, tp, **layer_kwargs(cls, index, cp, ep)))
    if shape.tie_word_embeddings:
        specs.append(TiedLayerSpec(TIED_KEY, Embedding, shape, tp, forward_fn=tied_lm_logits,
                                   tied_weight_attr=["weight"]))
    return specs


def _seed_layer(seed) -> None:
    # `type:` partitioning yields numpy stage bounds, and `random.seed` rejects numpy integers.
    seed_layer(int(seed))


def build_pipeline_module(shape: LlamaShape, layout: ParallelLayout, tp: TensorParallelGroup, *, seed: int,
                          partition_method: str = DEFAULT_PARTITION_METHOD,
                          cp: ContextParallelGroup | None = None, schedule: str = "1f1b",
                          virtual: int = 1, ep: ExpertParallelGroup | None = None) -> PipelineModule:
    """A PipelineModule over `layout.topology()`; for `schedule` "dualpipev" DeepSpeed's DualPipeVModule
    (2p stages; `deepspeed.initialize` then builds the DualPipeVEngine), for "interleaved" an
    InterleavedPipelineModule of `virtual` chunks per rank (v·p stages). `seed_layers` makes the initial
    weights independent of the partitioning (layer i is drawn after seeding `seed + i`)."""
    module_cls = {"dualpipev": DualPipeVModule, "1f1b": PipelineModule,
                  "interleaved": InterleavedPipelineModule}[schedule]
    kwargs = {"virtual_stages": virtual} if schedule == "interleaved" else {}
    if partition_method == COST_PARTITION_METHOD:  # DeepSpeed has no such method: the bounds are handed to it
        module_cls = with_stage_bounds(module_cls)
        kwargs["stage_bounds"] = functools.partial(stage_bounds, shape, method=partition_method)
    return module_cls(
        layers=pipeline_layer_specs(shape, tp, cp, ep),
        topology=layout.topology(),
        loss_fn=LanguageModelLoss(shape, tp, cp=cp),
        seed_layers=True,
        seed_fn=_seed_layer,
        base_seed=seed,
        partition_method=partition_method,
        **kwargs,
        # Only decoder blocks are checkpointed: the embedding's integer input cannot carry a
        # gradient through reentrant checkpointing, and every block has the same input shape,
        # which `contiguous_memory_optimization` requires.
        checkpointable_layers=[DecoderBlock.__name__],
    )

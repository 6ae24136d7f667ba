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
from hybrid3d.errors import LayoutError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import TIED_KEY
from hybrid3d.model.layers import DecoderBlock, Embedding, layer_classes, layer_kwargs, seed_layer, tied_lm_logits
from hybrid3d.model.llama import LanguageModelLoss
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.rank_groups import ContextParallelGroup, ExpertParallelGroup, TensorParallelGroup

# Balance decoder blocks across stages; the embedding joins the first stage and the final norm
# and head join the last one (DeepSpeed's `type:` partitioning counts only matching layers).
DEFAULT_PARTITION_METHOD = f"type:{DecoderBlock.__name__}"


@lru_cache(maxsize=256)
def stage_bounds(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layer-spec index bounds per stage under DEFAULT_PARTITION_METHOD, from DeepSpeed's own solver:
    stage s holds specs [bounds[s], bounds[s + 1]). The spec list is [embedding, L blocks, final
    norm, head] (a tied head is a second embedding spec), so it has L + 3 entries either way."""
    weights = [0] + [1] * num_layers + [0, 0]
    return tuple(int(x) for x in partition_balanced(weights=weights, num_parts=pp))


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
            specs.append(LayerSpec(cls, shape, tp, **layer_kwargs(cls, cp, ep)))
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
                  "interleaved": functools.partial(InterleavedPipelineModule, virtual_stages=virtual)}[schedule]
    return module_cls(
        layers=pipeline_layer_specs(shape, tp, cp, ep),
        topology=layout.topology(),
        loss_fn=LanguageModelLoss(shape, tp, cp=cp),
        seed_layers=True,
        seed_fn=_seed_layer,
        base_seed=seed,
        partition_method=partition_method,
        # Only decoder blocks are checkpointed: the embedding's integer input cannot carry a
        # gradient through reentrant checkpointing, and every block has the same input shape,
        # which `contiguous_memory_optimization` requires.
        checkpointable_layers=[DecoderBlock.__name__],
    )

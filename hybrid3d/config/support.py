"""The support table: which combinations of features hybrid3d runs, and a one-line refusal for each of the others.

A combination runs when a test compares it with Hugging Face (the equivalence matrix, tests/distributed/) or it is
impossible by construction; everything else is refused here, before anything is built, naming the keys. The engine
that serves each supported combination is training/engines.py's table; the layout's arithmetic (heads, kv heads,
layers per stage) is model/tp_plan.py's `check_split` and model/pipe.py's `check_schedule_stages`.

    feature                     refused with
    mixture of experts          CP; SP; document masks; pipeline_zero2;
                                reentrant checkpointing under DualPipeV; a (t, pp, ep) not in TESTED_MOE_LAYOUTS;
                                with EP under a pipeline, a stage of dense layers only (check_expert_stages)
    document masks (pp > 1)     a pipeline schedule other than 1F1B; pipeline_zero2
    interleaved / DualPipeV     pipeline_zero2
    compiled blocks             a mixture-of-experts model; an unknown backend; ZeRO-3
    ZeRO-3                      a pipeline (ds_checks); a mixture-of-experts model; the chunked loss
    offload                     stage 0; offload_param, NVMe or a partial ratio below stage 3; pipeline_zero2
                                (ds_checks.check_offload)
"""

from typing import Optional

from hybrid3d.config.sections import SECTION, CompileSection, HybridSection
from hybrid3d.errors import ConfigError, LayoutError
from hybrid3d.model.config import LlamaShape

# Mixture-of-experts layouts trained against HF Mixtral in tests/distributed/test_moe.py: (t, pp, ep).
TESTED_MOE_LAYOUTS = {(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1)}


def check_experts(num_experts: int, t: int, pp: int, cp: int, ep: int) -> None:
    """MoE layouts run only where tests compare them with HF (`TESTED_MOE_LAYOUTS`); the arithmetic (whole experts
    per EP rank) is model/tp_plan.py's `check_split`."""
    if not num_experts:
        return
    if cp > 1 or (t, pp, ep) not in TESTED_MOE_LAYOUTS:
        raise LayoutError(f"num_local_experts ({num_experts}): tensor_parallel_size {t}, pipeline_parallel_size "
                          f"{pp}, context_parallel_size {cp}, expert_parallel_size {ep} is not a tested "
                          f"mixture-of-experts layout (tested (t, pp, ep): {sorted(TESTED_MOE_LAYOUTS)}, cp 1)")


def check_expert_stages(shape: LlamaShape, pp: int, ep: int, stage_bounds: Optional[tuple]) -> None:
    """With expert parallelism under a pipeline every stage holds a MoE block: DeepSpeed's ZeRO-1/2 take each
    parameter group's gradient norm with an all-reduce of its own over the model-parallel group (`stage_1_and_2.py`
    `get_grad_norm_direct`), and a stage without experts has no expert group, so it would wait forever for the
    others (the dense first stage of a Qwen3-MoE with `mlp_only_layers` [0, 1], measured: a hang). `stage_bounds`:
    the run's `model.pipe.run_stage_bounds`, None for a partition method without modelled bounds."""
    if ep == 1 or pp == 1 or not shape.dense_layers:
        return
    if stage_bounds is None:
        raise LayoutError(f"expert_parallel_size {ep} with a pipeline and dense layers {list(shape.dense_layers)} "
                          f"needs {SECTION}.partition_method 'cost' or 'type:DecoderBlock' (stages whose blocks "
                          "are known)")
    for stage, (start, stop) in enumerate(zip(stage_bounds, stage_bounds[1:])):
        blocks = [i - 1 for i in range(max(start, 1), min(stop, shape.num_layers + 1))]
        if not any(shape.is_moe_layer(b) for b in blocks):
            raise LayoutError(f"pipeline stage {stage} holds only dense layers {blocks} (dense_layers "
                              f"{list(shape.dense_layers)}): expert_parallel_size {ep} needs a mixture-of-experts "
                              f"layer on every stage (fewer pipeline stages, or expert_parallel_size 1)")


def check_expert_kernel(shape: LlamaShape, tp: int, element_bytes: int) -> None:
    """`hybrid3d.expert_kernel` "grouped_mm" where torch's grouped GEMM cannot run (model/expert_kernels.py: no
    kernel, or strides it refuses) is refused before the model is built; the default (null) is the loop."""
    from hybrid3d.model.expert_kernels import choose_kernel

    if not shape.is_moe:
        return
    try:
        choose_kernel(shape.expert_kernel, shape.hidden_size, shape.expert_intermediate_size // tp, element_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_expert_bias_update(rate: float, router_score_bias: bool) -> None:
    """Aux-loss-free balancing moves the routers' score correction bias, which only DeepSeek-V3's router has."""
    if rate and not router_score_bias:
        raise ConfigError(f"{SECTION}.expert_bias_update_rate ({rate}) needs a router with e_score_correction_bias "
                          "(model_type deepseek_v3)")


def check_moe_options(is_moe: bool, pp: int, *, sequence_parallel: bool = False, schedule: str = "1f1b",
                      pipeline_zero2: bool = False, checkpoint_interval: int = 0, use_reentrant: bool = True,
                      capacity_factor: Optional[float] = None, document_mask: bool = False) -> None:
    """The options a mixture-of-experts model runs with, one line for each of the others. The router statistics
    travel between stages as the second tensor of the activation tuple. DeepSpeed's own PipelineEngine ran
    backward once per tensor of that tuple (`pipe/engine.py` `_exec_backward_pass`), which reentrant
    checkpointing cannot do (its saved tensors are freed by the first); hybrid3d's 1F1B engine for MoE stages runs
    one pass (ds_internals/tuple_backward.py), under which reentrant checkpointing runs (tests/distributed/
    test_moe.py, PP2 and PP2 x EP2). DualPipeV runs MoE stages with DeepSpeed's engine and its per-tensor backward,
    so non-reentrantly checkpointed only; the interleaved engine passes the tuple between chunks, each chunk's
    spec its own (ds_internals/interleaved_pipeline.py), with the same per-tensor backward. Sequence parallelism and
    `pipeline_zero2` are untested with experts."""
    if capacity_factor is not None and not (is_moe and capacity_factor > 0):
        raise ConfigError(f"{SECTION}.expert_capacity_factor ({capacity_factor}) must be > 0 and needs a "
                          "mixture-of-experts model")
    if not is_moe:
        return
    if sequence_parallel:
        raise ConfigError(f"{SECTION}.sequence_parallel cannot be combined with a mixture-of-experts model yet")
    if document_mask:
        raise ConfigError(f"{SECTION}.data.document_mask is untested with a mixture-of-experts model, so refused "
                          "for now")
    if pp > 1 and pipeline_zero2:
        raise ConfigError(f"a mixture-of-experts model runs without {SECTION}.pipeline_zero2 for now")
    if pp > 1 and checkpoint_interval and use_reentrant and schedule != "1f1b":  # per-tensor backward engines
        raise ConfigError(f"a mixture-of-experts model under {SECTION}.pipeline_schedule {schedule!r} needs "
                          "pipeline.use_reentrant=false with pipeline.activation_checkpoint_interval (its engine "
                          "backpropagates the activation tuple once per tensor, which reentrant checkpointing cannot)")


def check_document_mask(hybrid: HybridSection) -> None:
    """`data.document_mask` sends each token's position between pipeline stages with the hidden states; the
    1F1B engine is tested with it (tests/distributed/test_finetune.py), the other schedules and pipeline_zero2
    are not yet."""
    if not hybrid.data.document_mask or hybrid.pipeline_parallel_size == 1:
        return
    if hybrid.pipeline_schedule != "1f1b" or hybrid.pipeline_zero2:
        what = "pipeline_zero2" if hybrid.pipeline_zero2 else f"pipeline_schedule {hybrid.pipeline_schedule!r}"
        raise ConfigError(f"{SECTION}.data.document_mask runs with pipeline_schedule '1f1b' and without "
                          f"pipeline_zero2 only for now, not with {what}")


def check_schedule_with_pipeline_zero2(hybrid: HybridSection) -> None:
    """pipeline_zero2's engine subclasses DeepSpeed's 1F1B PipelineEngine; the other schedules have engines of
    their own."""
    if hybrid.pipeline_zero2 and hybrid.pipeline_schedule != "1f1b":
        raise ConfigError(f"{SECTION}.pipeline_zero2 cannot run with {SECTION}.pipeline_schedule="
                          f"{hybrid.pipeline_schedule!r} (use zero_optimization.stage 1)")


def check_ring_attention(hybrid: HybridSection, attention_dropout: float) -> None:
    """Ring attention (context_parallel_comm 'p2p' or 'a2a+p2p') runs its blocks without dropout
    (parallel/attention_blocks.py), masked to packed documents and sliding windows where asked."""
    if hybrid.context_parallel_size == 1 or hybrid.context_parallel_comm == "a2a":
        return
    if attention_dropout:
        raise ConfigError(f"{SECTION}.context_parallel_comm {hybrid.context_parallel_comm!r} does not support "
                          "attention_dropout > 0 yet")


def check_lora(is_moe: bool, pipeline_zero2: bool) -> None:
    """LoRA (hybrid3d.lora) runs with every layout, schedule and ZeRO stage of a dense model, except: experts carry
    no adapters, and pipeline_zero2's deferred gradients assume every parameter of a stage is trained."""
    if is_moe:
        raise ConfigError("hybrid3d.lora: LoRA on a mixture-of-experts model (its experts) is not supported")
    if pipeline_zero2:
        raise ConfigError("hybrid3d.lora: not supported with hybrid3d.pipeline_zero2 (use ZeRO-1 with pipeline "
                          "stages, or ZeRO-2 without them)")


def check_compile(section: CompileSection, is_moe: bool) -> None:
    """Compiled decoder blocks (`hybrid3d.compile`, training/compile.py): a backend Dynamo knows; not with experts,
    whose token counts per expert are data-dependent shapes (model/moe.py's torch.where per expert)."""
    if not section.enabled:
        return
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if section.backend not in backends:
        raise ConfigError(f"{SECTION}.compile.backend must be one of {', '.join(sorted(backends))}, "
                          f"got {section.backend!r}")
    if is_moe:
        raise ConfigError(f"{SECTION}.compile.enabled is not supported with a mixture-of-experts model yet")


def check_zero3(stage: int, is_moe: bool, loss_chunk_tokens: int, compiled: bool) -> None:
    """ZeRO-3 (`zero_optimization.stage` 3; pipeline_parallel_size 1, ds_checks.check_zero_and_precision) runs a
    dense model with TP, SP, CP and LoRA (tests/distributed/test_engine.py, test_lora.py). It gathers a parameter
    around the forward and backward of the module that owns it (ds_internals/zero3.py), so: the chunked loss, which
    applies the head's weight in the loss outside any module, is refused; experts (their own expert-data-parallel
    groups) and compiled blocks (Dynamo tracing ZeRO-3's gather hooks) are untested with it, so refused for now."""
    if stage != 3:
        return
    if is_moe:
        raise ConfigError("zero_optimization.stage=3 is not supported with a mixture-of-experts model yet (use stage "
                          "1 or 2): ZeRO-3 runs dense models with tensor, sequence and context parallelism and LoRA")
    if loss_chunk_tokens:
        raise ConfigError(f"{SECTION}.loss_chunk_tokens cannot run with zero_optimization.stage=3: the chunked loss "
                          "applies the head's weight outside the head's forward, where ZeRO-3 holds only its partition")
    if compiled:
        raise ConfigError(f"{SECTION}.compile.enabled is not supported with zero_optimization.stage=3 yet")

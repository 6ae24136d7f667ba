"""One validation pass: a DeepSpeed JSON, a world size and a model shape become a `ValidRun`, the only input
`build_trainer` takes: start-up's third phase (training/entry.py `validate`), every refusal that needs no file.

Each rule has one owner and is checked here once, before any process group exists:
- the DeepSpeed keys and the hybrid3d section, one key at a time: `config.run_config.parse_config`
  (its `config.ds_checks` functions hold the combinations of keys refused, each with its line);
- the layout for the world size (divisibility, SP needs TP, EP divides DP): `parallel.layout.ParallelLayout`;
- the layout against the model (heads, kv heads, vocabulary, layers per stage, whole experts): `model.tp_plan`
  `check_split`, `model.pipe.check_schedule_stages`; the combinations run (experts, rings, compile, ZeRO-3):
  `config.support`;
- the sequence against the model's positions: below.
The refusals that read a file (data, output folders, the checkpoint to resume, the HF weights) are their owners',
called by start-up's fourth phase (training/entry.py `open_run`).
"""

import dataclasses
import math

from deepspeed.accelerator import get_accelerator

from hybrid3d.config.run_config import RunConfig, parse_config
from hybrid3d.config.sections import HybridSection
from hybrid3d.errors import ConfigError
from hybrid3d.model.adapters import with_adapters
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.peft_adapter import read_adapter_config
from hybrid3d.model.pipe import check_schedule_stages, run_stage_bounds
from hybrid3d.config.support import (check_compile, check_expert_bias_update, check_expert_kernel, check_expert_stages,
                                     check_experts, check_lora, check_moe_options, check_ring_attention, check_zero3)
from hybrid3d.model.tp_plan import check_split
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.standalone import launch_hint


@dataclasses.dataclass(frozen=True)
class ValidRun:
    """A config that passed every check for `layout`, and the shape the model is built with (the section's
    vocabulary padding and expert capacity factor applied: what checkpoints record)."""

    config: RunConfig
    shape: LlamaShape

    @property
    def layout(self) -> ParallelLayout:
        return self.config.layout

    def with_partition(self, method: str) -> "ValidRun":
        """This run with its pipeline cut by `method` (a resume keeping its checkpoint's stages)."""
        hybrid = dataclasses.replace(self.config.hybrid, partition_method=method)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, hybrid=hybrid))


def validate_run(raw: dict, world_size: int, shape: LlamaShape, on_cpu: bool | None = None,
                 hybrid: HybridSection | None = None) -> ValidRun:
    """`raw`: the DeepSpeed JSON with its "hybrid3d" section; `on_cpu`: None asks DeepSpeed's accelerator;
    `hybrid`: that section if the caller already parsed it (entry.prepare reads the model from it first).
    Raises a `UserError` naming the key."""
    if on_cpu is None:
        on_cpu = get_accelerator().device_name() == "cpu"
    config = parse_config(raw, world_size, num_layers=shape.num_layers, on_cpu=on_cpu, hybrid=hybrid)
    hybrid = config.hybrid
    layout = config.layout
    shape = run_shape(shape, hybrid)
    check_split(shape, layout.tp, layout.pp, layout.cp, layout.ep, ring=layout.ring, cp_a2a=layout.cp_a2a)
    check_experts(shape.num_experts, layout.tp, layout.pp, layout.cp, layout.ep)
    check_ring_attention(hybrid, shape.attention_dropout)
    check_compile(hybrid.compile, shape.is_moe)
    check_moe_options(shape.is_moe, layout.pp, sequence_parallel=layout.sp, schedule=hybrid.pipeline_schedule,
                      pipeline_zero2=hybrid.pipeline_zero2, checkpoint_interval=config.checkpoint_interval,
                      use_reentrant=config.use_reentrant, capacity_factor=hybrid.expert_capacity_factor,
                      document_mask=hybrid.data.document_mask)
    check_zero3(config.zero_stage, shape.is_moe, shape.loss_chunk_tokens, hybrid.compile.enabled)
    check_expert_bias_update(hybrid.expert_bias_update_rate, shape.router_score_bias)
    half = any(config.ds_config.get(k, {}).get("enabled", False) for k in ("bf16", "fp16"))
    check_expert_kernel(shape, layout.tp, 2 if half else 4)
    check_schedule_stages(shape, layout.pp, hybrid.pipeline_schedule, hybrid.virtual_pipeline_size)
    if layout.ep > 1 and layout.pp > 1:  # the bounds once the schedule's stages are known to be cuttable
        check_expert_stages(shape, layout.pp, layout.ep, run_stage_bounds(
            shape, layout.pp, hybrid.pipeline_schedule, hybrid.virtual_pipeline_size, hybrid.partition_method))
    if hybrid.data.seq_length > shape.max_position_embeddings:
        raise ConfigError(f"hybrid3d.data.seq_length ({hybrid.data.seq_length}) exceeds the model's "
                          f"max_position_embeddings ({shape.max_position_embeddings})")
    return ValidRun(config, shape)


def check_single_process(hybrid: HybridSection) -> None:
    """A process started without a launcher is a world of one rank: a layout of more is refused, saying how to
    launch it (data parallelism alone just runs on the one rank)."""
    sizes = {k: getattr(hybrid, k) for k in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")}
    ranks = math.prod(sizes.values())
    if ranks > 1:
        what = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
        raise ConfigError(launch_hint(ranks, f"hybrid3d.{what}", "launch/train.py --deepspeed_config ..."))


def run_shape(shape: LlamaShape, hybrid: HybridSection) -> LlamaShape:
    """`shape` as the run builds it: the section's vocabulary padding, loss chunks, expert kernel and capacity, and
    adapters."""
    shape = dataclasses.replace(shape, vocab_pad_multiple=hybrid.vocab_pad_multiple,
                                loss_chunk_tokens=hybrid.loss_chunk_tokens, expert_kernel=hybrid.expert_kernel)
    if hybrid.expert_capacity_factor is not None:
        shape = dataclasses.replace(shape, expert_capacity_factor=hybrid.expert_capacity_factor)
    return with_lora(shape, hybrid)


def with_lora(shape: LlamaShape, hybrid: HybridSection) -> LlamaShape:
    """`shape` with the adapters hybrid3d.lora asks for (checked against its adapter folder, if any)."""
    lora = hybrid.lora
    if lora.rank is None:
        return shape
    check_lora(shape.is_moe, hybrid.pipeline_zero2)
    shape = with_adapters(shape, lora.rank, lora.target_modules, lora_alpha=lora.alpha, lora_dropout=lora.dropout)
    if lora.adapter is not None:
        saved = read_adapter_config(lora.adapter)
        for ours, key in ((lora.rank, "r"), (lora.alpha, "lora_alpha"),
                          (sorted(shape.lora_targets), "target_modules")):
            theirs = sorted(saved.get(key) or []) if key == "target_modules" else saved.get(key)
            if theirs != ours:
                raise ConfigError(f"hybrid3d.lora.adapter: {lora.adapter}/adapter_config.json has {key} = {theirs!r}, "
                                  f"hybrid3d.lora asks for {ours!r}")
    return shape

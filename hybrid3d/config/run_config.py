"""The whole DeepSpeed JSON for a world size: the hybrid3d section parsed, the DeepSpeed keys checked,
and the JSON DeepSpeed receives."""

import json
from dataclasses import dataclass, field, replace

from hybrid3d.config.ds_checks import (
    apply_activation_checkpointing,
    check_activation_checkpointing,
    check_expert_parallel,
    check_checkpoint_engine,
    check_evaluation,
    check_nonfinite_policy,
    check_pipeline_schedule,
    check_offload,
    check_pipeline_zero2,
    check_sequence_splits,
    check_zero_and_precision,
    complete_batch_sizes,
)
from hybrid3d.config.ds_keys import check_deepspeed_keys
from hybrid3d.config.support import check_document_mask
from hybrid3d.config.sections import SECTION, HybridSection, parse_hybrid_section
from hybrid3d.parallel.layout import ParallelLayout


@dataclass
class RunConfig:
    """`ds_config` is what DeepSpeed receives: the JSON without the hybrid3d section, with the
    batch sizes completed (train = micro x GAS x DP). With context parallelism DeepSpeed counts the c
    ranks of a CP group as data-parallel replicas (parallel/layout.py), so its `train_batch_size` is c times
    the sequences a step trains on (`sequences_per_step`, the JSON's `train_batch_size`)."""

    hybrid: HybridSection
    layout: ParallelLayout
    ds_config: dict = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.hybrid.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.hybrid.pipeline_parallel_size

    @property
    def cp(self) -> int:
        return self.hybrid.context_parallel_size

    @property
    def ep(self) -> int:
        return self.hybrid.expert_parallel_size

    @property
    def sp(self) -> bool:
        return self.hybrid.sequence_parallel

    @property
    def sequences_per_step(self) -> int:
        return self.ds_config["train_batch_size"] // self.cp

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def micro_batch_size(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def checkpoint_interval(self) -> int:
        return int(self.ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0))

    @property
    def use_reentrant(self) -> bool:
        return self.ds_config.get("pipeline", {}).get("use_reentrant", True) is not False

    def for_engine(self, load_universal: bool = False) -> "RunConfig":
        """This config with a private copy of the DeepSpeed dict for one engine (DeepSpeed edits its config in
        place); `load_universal`: the checkpoint it loads is DeepSpeed's universal one, which the engine must know
        at initialisation."""
        ds = json.loads(json.dumps(self.ds_config))
        if load_universal:
            ds.setdefault("checkpoint", {})["load_universal"] = True
        return replace(self, ds_config=ds)


def forward_only_config(micro_batch: int, tp: int, pp: int, vocab_pad_multiple: int, ep: int, bf16: bool) -> dict:
    """The DeepSpeed JSON of a run that only runs forward passes at a checkpoint's layout (`python -m
    hybrid3d.convert.verify`). Expert parallelism runs under ZeRO-1/2 only (config/ds_checks.py), which needs an
    optimizer: it is never stepped (its fp32 master copy is the memory cost of checking an EP checkpoint at its
    layout)."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        SECTION: {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "vocab_pad_multiple": vocab_pad_multiple,
                  "expert_parallel_size": ep},
    }
    if ep > 1:
        config["zero_optimization"] = {"stage": 1}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def parse_config(raw: dict, world_size: int, num_layers: int | None = None, on_cpu: bool = True,
                 hybrid: HybridSection | None = None) -> RunConfig:
    """Validate a DeepSpeed JSON (already loaded) for `world_size` ranks; `hybrid`: its section, if the
    caller parsed it already. The checks that need the model too: `config.validation.validate_run`."""
    check_deepspeed_keys({k: v for k, v in raw.items() if k != SECTION})
    hybrid = hybrid if hybrid is not None else parse_hybrid_section(raw)
    layout = ParallelLayout.for_world(world_size, hybrid.tensor_parallel_size, hybrid.pipeline_parallel_size,
                                      hybrid.context_parallel_size, hybrid.sequence_parallel,
                                      hybrid.expert_parallel_size, ring=hybrid.context_parallel_comm != "a2a",
                                      cp_a2a=hybrid.context_parallel_a2a_size)
    ds = {k: v for k, v in raw.items() if k != SECTION}
    ds = json.loads(json.dumps(ds))  # a private deep copy: DeepSpeed edits its config in place
    check_sequence_splits(ds, hybrid)
    complete_batch_sizes(ds, layout.dp)
    ds["train_batch_size"] *= layout.cp  # DeepSpeed's replicas: d·c (RunConfig docstring)
    check_pipeline_schedule(ds, hybrid)
    check_document_mask(hybrid)
    check_evaluation(hybrid)
    check_zero_and_precision(ds, layout.pp, hybrid.pipeline_zero2)
    check_offload(ds, layout.tp, layout.cp)
    check_pipeline_zero2(ds, hybrid)
    check_expert_parallel(ds, hybrid)
    check_nonfinite_policy(ds, hybrid.train.on_nonfinite)
    check_checkpoint_engine(ds)
    apply_activation_checkpointing(ds, hybrid)
    check_activation_checkpointing(ds, layout.pp, num_layers, on_cpu)
    return RunConfig(hybrid=hybrid, layout=layout, ds_config=ds)

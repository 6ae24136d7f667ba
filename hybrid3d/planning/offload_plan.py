"""The planner's ZeRO-3 and offload rows: which (ZeRO stage, offload) options a layout gets, and the worst rank's
device and host bytes for them (planning/zero3_memory.py's model of DeepSpeed's tensors).

Options (`offload_options`), as the trainer accepts them (config/support.check_zero3, config/ds_checks.check_offload):
- ZeRO-3 without a pipeline, not for a mixture-of-experts model or the chunked loss: no offload,
  `offload_optimizer`, or `offload_optimizer` + `offload_param` (with LoRA no offload: the adapters' states are
  small, the frozen base is partitioned like every weight);
- ZeRO-1 (any pipeline) and ZeRO-2 without a pipeline: `offload_optimizer` too (pipeline_zero2 refuses offload);
- ZeRO-0: none. LoRA rows keep to no offload.
Offload rows plan bf16 gradient accumulation (DeepSpeed then takes DeepSpeedZeroOptimizer, whose offload path
accumulates on the host); the others keep the planner's precision (`planner.planned_precision`).
"""

from hybrid3d.config.auto_values import NO_OFFLOAD  # the offload kinds are the config's vocabulary
from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.activations import activation_bytes
from hybrid3d.planning.memory import compute_bytes, rank_model_states
from hybrid3d.planning.parameters import rank_adapter_numels, rank_parameter_numels
from hybrid3d.planning.zero3_fetch import Zero3Knobs
from hybrid3d.planning.zero3_memory import (
    live_parameter_bytes,
    lora_zero3_model_states,
    offload_states,
    zero3_model_states,
)


def zero3_allowed(shape: LlamaShape, pp: int) -> bool:
    """ZeRO-3 is a planner option: no pipeline, a dense model, the loss in one piece."""
    return pp == 1 and not shape.is_moe and not shape.loss_chunk_tokens


def offload_options(shape: LlamaShape, pp: int, zero: int) -> tuple[str, ...]:
    """The `offload` values (zero3_memory.OFFLOAD_CHOICES) a row at ZeRO stage `zero` and pp stages may take."""
    if shape.lora_rank or zero == 0 or (zero == 2 and pp > 1):
        return (NO_OFFLOAD,)
    if zero == 3:
        return (NO_OFFLOAD, "optimizer", "optimizer+params")
    return (NO_OFFLOAD, "optimizer")


def worst_rank_placed(shape: LlamaShape, tp: int, pp: int, nd: int, zero: int, precision: str, offload: str,
                      checkpointing: bool, b: int, s: int, gas: int, bucket: int, sp: bool = False, cp: int = 1,
                      schedule: str = "1f1b", v: int = 1, comm: str = "a2a",
                      cp_a2a: int = 1, zero3: Zero3Knobs = Zero3Knobs()) -> tuple[float, float, float]:
    """(device model states, activations, host bytes) of the pipeline rank with the most device memory, for ZeRO-3
    (p = 1; the gathered parameters, by its `zero3` knobs, counted with the states) or an offloading ZeRO-1/2 row;
    ZeRO over nd = d·c ranks."""
    worst = (0.0, 0.0, 0.0)
    for rank in range(pp):
        numels = rank_parameter_numels(shape, tp, pp, rank, schedule, v)
        if zero == 3 and shape.lora_rank:
            placed = lora_zero3_model_states(numels, rank_adapter_numels(shape, tp, 1, 0), nd, precision, bucket,
                                             zero3.persistence_threshold)
            device = placed.device_bytes + live_parameter_bytes(shape, tp, precision, zero3)
        elif zero == 3:
            placed = zero3_model_states(numels, nd, precision, bucket, zero3.persistence_threshold, offload)
            device = placed.device_bytes + live_parameter_bytes(shape, tp, precision, zero3)
        else:
            dp_ranks = (0, nd - 1) if zero == 2 else (0,)  # ZeRO-2's gradient partition depends on the DP rank
            placed = max((offload_states(rank_model_states(shape, tp, pp, nd, zero, precision, rank, r, gas, bucket,
                                                           schedule=schedule, virtual=v), numels, nd, zero, precision, r,
                                         gas, bucket) for r in dp_ranks), key=lambda p: p.device_bytes)
            device = placed.device_bytes
        acts = activation_bytes(shape, b, s, tp, pp, rank, gas, checkpointing=checkpointing, sequence_parallel=sp,
                                cp=cp, schedule=schedule, virtual=v, comm=comm, cp_a2a=cp_a2a,
                                lp=compute_bytes(precision))
        if device + acts > worst[0] + worst[1]:
            worst = (device, acts, placed.host_bytes)
    return worst

"""The training job's "auto" step (planning/auto_layout.py decides): the budget, the machine and a checkpoint's
layout gathered from what a rank knows before any process group exists, the decision written into the config.

Every rank computes the same decision from the same inputs (the config, the model's shape, the world size, the
budget: `hybrid3d.device_memory_gb`, else the accelerator's total memory, the same on a cluster of one GPU type).
A resume at the world size its checkpoint was written at keeps the checkpoint's sizes, schedule and ZeRO stage for
the keys left "auto" (what the files were written at), deciding the rest as before; at another world size it plans
again, and the resume reshards through the universal checkpoint as any layout change does.
"""

import dataclasses
from typing import Optional

from hybrid3d.checkpoint.files import read_meta
from hybrid3d.checkpoint.resume import find_checkpoint
from hybrid3d.checkpoint.schema import saved_layout, saved_schedule
from hybrid3d.config.sections import HybridSection
from hybrid3d.errors import ConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.threads import local_ranks, usable_cores
from hybrid3d.config.auto_values import read_request
from hybrid3d.config.request import RunRequest
from hybrid3d.planning.auto_layout import apply_choice, decide, report_lines
from hybrid3d.planning.machines import cpu_cluster, device_gpu, gpu_cluster, host_memory_gb, nvlink_count
from hybrid3d.planning.step_time import Cluster
from hybrid3d.config.validation import run_shape

def _budget_gb(hybrid: HybridSection, on_cpu: bool) -> float:
    if hybrid.device_memory_gb is not None:
        return hybrid.device_memory_gb
    if on_cpu:
        raise ConfigError("\"auto\" on the CPU needs hybrid3d.device_memory_gb: the memory budget of a rank in GB (an "
                          "artificial cap on what the memory model counts; the CPU has no device memory of its own)")
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().total_memory() / 1e9


def _cluster(world_size: int, budget_gb: float, precision: str, hybrid: HybridSection,
             on_cpu: bool) -> tuple[Cluster, str]:
    """The machine and where its figures come from (planning/machines.py: measured on the CPU; on a GPU the row of
    planning/gpus.py its device name picks, checked against the NVLinks the driver reports)."""
    if on_cpu:
        return (cpu_cluster(world_size, budget_gb, usable_cores(), precision),
                "CPU rates measured by benchmarks/step_time_check.py")
    import torch

    gpu, source = device_gpu(torch.cuda.get_device_name(), nvlink_count())
    cluster = gpu_cluster(world_size, budget_gb, local_ranks(), gpu, host_memory_gb(),
                          peak_tflops=hybrid.train.peak_tflops)
    peak = "hybrid3d.train.peak_tflops" if hybrid.train.peak_tflops else "the datasheet's"
    return cluster, (f"{source}: {cluster.peak_tflops:g} TFLOP/s bf16 ({peak}), {cluster.intra_node_gbps:.3g} GB/s "
                     f"in a node ({gpu.link}), {cluster.inter_node_gbps:g} GB/s across nodes")


def _checkpoint_layout(hybrid: HybridSection, world_size: int) -> Optional[tuple[dict, str]]:
    """The sizes, schedule and stage of the checkpoint a resume loads, when it was written at this world size."""
    if not hybrid.checkpoint.load:
        return None
    load_dir, tag = find_checkpoint(hybrid.checkpoint.load, hybrid.checkpoint_dir)
    meta = read_meta(load_dir / tag)
    if meta is None:  # plan_resume names the missing file
        return None
    layout = saved_layout(meta)
    where = f"{load_dir / tag}"
    if layout["tp"] * layout["pp"] * layout["dp"] * layout.get("cp", 1) != world_size:
        return {}, f"planned again: {where} was written at another world size; the resume reshards it"
    schedule = saved_schedule(layout)
    kept = {"tp": layout["tp"], "pp": layout["pp"], "cp": layout.get("cp", 1), "schedule": schedule["schedule"],
            "virtual": schedule["virtual"], "zero": layout.get("zero")}
    return {k: v for k, v in kept.items() if v is not None}, f"the sizes of {where}"


def resolve_auto(request: RunRequest, shape: LlamaShape, world_size: int, on_cpu: bool) -> tuple[dict, list[str]]:
    """(the request's config with its "auto" keys decided, the start-up lines saying what was chosen and why): a new
    dict, the request's own stays as given (itself and no lines when nothing is "auto"). `shape`: the model as its HF config gives it (the section's padding, loss
    chunks and adapters are applied here, as config.validation.run_shape applies them)."""
    raw, keys, hybrid = request.raw, request.auto, request.hybrid
    if not keys:
        return raw, []
    shape = run_shape(shape, hybrid)
    request = read_request(raw, keys)
    kept = _checkpoint_layout(hybrid, world_size)
    note = None
    if kept is not None:
        values, note = kept
        virtual = values.pop("virtual", None)
        keep = {k: v for k, v in values.items() if k in request.open}
        request = dataclasses.replace(request, fixed={**request.fixed, **keep}, open=request.open - set(keep),
                                      virtual=virtual if "schedule" in keep else request.virtual)
    budget = _budget_gb(hybrid, on_cpu)
    cluster, source = _cluster(world_size, budget, request.precision, hybrid, on_cpu)
    decision = decide(shape, cluster, request, offload=not on_cpu)
    if note:
        decision = dataclasses.replace(decision, kept=note)
    return apply_choice(raw, decision.chosen, keys), report_lines(decision, source)

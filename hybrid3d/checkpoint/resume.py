"""Where `checkpoint.load` points, whether that checkpoint is whole and is this model's, and how to
load it into the current layout (natively, or resharded through DeepSpeed's universal checkpoint)."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybrid3d.checkpoint.files import META_FILE, read_meta
from hybrid3d.checkpoint.schema import (is_module_only, manifest, recorded_schedule, saved_layout, saved_schedule,
                                      saved_step as checkpoint_step, structure)
from hybrid3d.config.validation import ValidRun
from hybrid3d.errors import CheckpointError, ConfigError
from hybrid3d.model.pipe import DEFAULT_PARTITION_METHOD, run_stage_bounds


@dataclass
class ResumePlan:
    """What `checkpoint.load` points at and how to load it into the current layout."""

    load_dir: Path  # the folder holding `latest` and the tag folders
    tag: str
    meta: dict  # contents of the tag's hybrid3d.json
    module_only: bool  # weights only (a converted HF model): fresh optimizer, step 0
    universal: bool  # the layout differs: reshard through DeepSpeed's universal checkpoint
    partition: Optional[str] = None  # the checkpoint's partition method, which this run keeps (None: the run's own)
    why: str = ""  # why the stages load as they do, when the checkpoint's were cut another way

    @property
    def universal_tag(self) -> str:
        return f"{self.tag}_universal"


def find_checkpoint(load: str, save_dir: Optional[str]) -> tuple[Path, str]:
    """Resolve `checkpoint.load` ('latest', a save_dir with a `latest` file, or a tag folder)."""
    key = "hybrid3d.checkpoint.load"
    if load == "latest":
        if not save_dir:
            raise ConfigError(f"{key}=latest needs hybrid3d.checkpoint.save_dir")
        folder = Path(save_dir)
    else:
        folder = Path(load)
    latest = folder / "latest"
    if load == "latest" and not latest.is_file() and not (folder / META_FILE).is_file():
        raise ConfigError(f"{key}=latest: there is no checkpoint in {folder} yet (nothing to resume: leave "
                          "checkpoint.load unset for a new run)")
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder")
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (folder / tag).is_dir():
            raise ConfigError(f"{key}: {latest} names tag {tag!r}, but {folder / tag} does not exist")
        return folder, tag
    if (folder / META_FILE).is_file():  # a tag folder itself
        return folder.parent, folder.name
    raise ConfigError(f"{key}: {folder} has neither a 'latest' file nor a {META_FILE} (not a hybrid3d checkpoint)")


def check_manifest(tag_dir: Path, meta: dict) -> None:
    """Missing or truncated files (per the manifest written at commit) -> CheckpointError naming the file."""
    for name, size in manifest(meta).items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointError(f"hybrid3d.checkpoint.load: {path} is missing (the checkpoint is incomplete)")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"hybrid3d.checkpoint.load: {path} has {actual} bytes, the manifest says {size} "
                              "(truncated or overwritten)")


def plan_resume(load: str, save_dir: Optional[str], tp: int, pp: int, dp: int, shape_dict: dict,
                cp: int = 1, schedule: str = "1f1b", virtual: int = 1, ep: int = 1,
                partition: str = DEFAULT_PARTITION_METHOD, partition_set: bool = True,
                bounds: Optional[Sequence[int]] = None, zero: int = 1) -> ResumePlan:
    """Check the checkpoint against the model and decide native vs universal loading (a checkpoint
    saved before context parallelism existed has cp = 1; ZeRO partitions span d·c ranks). The pipeline
    schedule decides which layers a rank holds (DualPipeV: stages r and 2p-1-r; interleaved: r + k·p), so
    a checkpoint of another schedule at the same sizes is resharded too; one saved before schedules and methods
    were recorded is 1F1B cut by block count. `bounds`: the stage bounds `partition` gives (None if unmodelled).
    Stages cut another way at the same layout (`partition_stages`) are kept when `partition_set` is false
    (hybrid3d.partition_method left to its default), else resharded."""
    load_dir, tag = find_checkpoint(load, save_dir)
    meta = read_meta(load_dir / tag)
    if meta is None:
        raise CheckpointError(f"hybrid3d.checkpoint.load: {load_dir / tag / META_FILE} is missing")
    saved_shape, ours = structure(meta.get("shape", {})), structure(shape_dict)  # what a resume must match
    differing = sorted(k for k in ours if k in saved_shape and saved_shape[k] != ours[k])
    if differing:
        first = differing[0]
        raise CheckpointError(f"hybrid3d.checkpoint.load: {load_dir / tag} holds another model "
                          f"({first}={saved_shape[first]}, this run has {ours[first]})")
    check_manifest(load_dir / tag, meta)
    saved = saved_layout(meta)
    module_only = is_module_only(meta)
    if module_only and (saved["tp"], saved["pp"]) != (tp, pp):
        raise ConfigError(f"hybrid3d.checkpoint.load: {load_dir / tag} holds weights only, converted for "
                          f"tp={saved['tp']} pp={saved['pp']}; this run has tp={tp} pp={pp}: convert again "
                          f"with --tp {tp} --pp {pp}")
    theirs, ours = saved_schedule(saved), recorded_schedule(pp, schedule, virtual, partition)
    # ZeRO-1 and 2 write the same files, ZeRO-3 others: a change to or from stage 3 reshards too
    written_at = (saved["tp"], saved["pp"], saved["dp"], saved.get("cp", 1), saved.get("ep", 1), theirs["schedule"],
                  theirs["virtual"], saved.get("zero") == 3)
    here = (tp, pp, dp, cp, ep, ours["schedule"], ours["virtual"], zero == 3)
    plan = ResumePlan(load_dir=load_dir, tag=tag, meta=meta, module_only=module_only,
                      universal=not module_only and written_at != here)
    if plan.universal and 3 in (saved.get("zero"), zero) and (saved["tp"], tp) != (1, 1):
        raise ConfigError(f"hybrid3d.checkpoint.load: {load_dir / tag} was saved at layout {saved}; with ZeRO-3 on "
                          "either side a checkpoint reshards only at tensor_parallel_size 1 (DeepSpeed's universal "
                          f"checkpoint for stage 3 is data-parallel only), this run has tp={tp}: resume at the saved "
                          "layout, or export it with hybrid2hf and start from the HF folder")
    if module_only or plan.universal:  # weights only load by layer whatever the stages; a reshard re-cuts them
        return plan
    return partition_stages(plan, saved, ours["partition"], partition_set, bounds)


def plan_run_resume(run: ValidRun, save_dir: Path, partition_set: bool) -> ResumePlan:
    """`plan_resume` for a validated run (`partition_set`: hybrid3d.partition_method given), with the run kept at
    the checkpoint's stages where the plan says so (`ResumePlan.run`). The checkpoints a universal resume cannot
    reshard (experts, adapters) are refused."""
    hybrid, layout, shape = run.config.hybrid, run.layout, run.shape
    schedule = (hybrid.pipeline_schedule, hybrid.virtual_pipeline_size)
    plan = plan_resume(hybrid.checkpoint.load, str(save_dir), layout.tp, layout.pp, layout.dp,
                       structure(dataclasses.asdict(shape)),
                       cp=layout.cp, **recorded_schedule(layout.pp, *schedule, hybrid.partition_method),
                       ep=layout.ep, partition_set=partition_set,
                       bounds=run_stage_bounds(shape, layout.pp, *schedule, hybrid.partition_method),
                       zero=run.config.zero_stage)
    if plan.universal and shape.is_moe:  # ds_to_universal knows nothing of experts (or their placement)
        raise ConfigError(f"hybrid3d.checkpoint.load: {plan.load_dir / plan.tag} was saved at layout "
                          f"{plan.meta['layout']}; a mixture-of-experts checkpoint resumes at the same layout only")
    if plan.universal and shape.lora_rank:  # adapter-only files: no universal conversion built for them yet
        raise ConfigError(f"hybrid3d.checkpoint.load: {plan.load_dir / plan.tag} was saved at layout "
                          f"{plan.meta['layout']}; a LoRA checkpoint resumes at the same layout only (or export "
                          "it with hybrid2hf --lora adapter and start from it with hybrid3d.lora.adapter)")
    return plan


def check_steps_left(plan: Optional[ResumePlan], steps: int, eval_only: bool) -> None:
    """An evaluation needs a checkpoint; a training run needs steps beyond the checkpoint's."""
    if eval_only and plan is None:
        raise ConfigError("--eval-only needs hybrid3d.checkpoint.load")
    saved_step = checkpoint_step(plan.meta) if plan is not None else 0
    if not eval_only and saved_step >= steps:
        raise ConfigError(f"hybrid3d.train.steps ({steps}) is not above the step of the checkpoint "
                          f"{plan.load_dir / plan.tag} ({saved_step}): nothing to train (raise train.steps, or "
                          "use --eval-only to evaluate it)")


def partition_stages(plan: ResumePlan, saved: dict, partition: str, partition_set: bool,
                     bounds: Optional[Sequence[int]]) -> ResumePlan:
    """A checkpoint saved at this run's layout: the same stages when its partition method is the run's, or its
    recorded bounds are; else its own stages kept, which its files were written for (no reshard), when the run
    left hybrid3d.partition_method unset (a checkpoint of the count-balanced default before "cost"); else the
    method the run sets, through the universal checkpoint. `why` says which, for the job's one line."""
    method, recorded = saved_schedule(saved)["partition"], saved.get("stage_bounds")
    if method == partition or (recorded is not None and bounds is not None and list(recorded) == list(bounds)):
        return plan
    cut = f"partition_method {method!r}" + (f" (layer-spec bounds {list(recorded)})" if recorded else "")
    if not partition_set:
        plan.partition = method
        plan.why = (f"they were cut by {cut} at this layout, so its files load as saved, without a reshard "
                    f"(hybrid3d.partition_method is unset; set it to re-cut them through the universal checkpoint)")
        return plan
    plan.universal = True
    plan.why = (f"its stages were cut by {cut}, hybrid3d.partition_method {partition!r} cuts them"
                + (f" {list(bounds)}" if bounds is not None else " otherwise"))
    return plan

"""Build the TP Llama and hand it to DeepSpeed; one trainer interface for both kinds of engine.

- pp > 1: a PipelineModule (or DeepSpeed's DualPipeVModule, hybrid3d's InterleavedPipelineModule) and a
  pipeline engine: `PipelineTrainer`;
- pp = 1: LlamaSequential + DeepSpeedEngine with the layout's `mpu`: `DataParallelTrainer`.
Which engine serves which combination is training/engines.py's table.
With context parallelism each rank feeds the model its s/c positions of every sequence (`sequence_shard`).

DeepSpeed parses the `activation_checkpointing` JSON section but never applies it, so
`build_trainer` calls `deepspeed.checkpointing.configure` with the layout's process groups.
"""

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import deepspeed.comm as dist
import torch
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from hybrid3d.checkpoint.experts import check_expert_checkpoints, load_experts, save_experts
from hybrid3d.checkpoint.files import read_meta
from hybrid3d.checkpoint.schema import is_module_only
from hybrid3d.checkpoint.universal import universal_checkpoint_info
from hybrid3d.config.ds_checks import turn_off_pipe_partitioning
from hybrid3d.config.run_config import RunConfig
from hybrid3d.data.packing import MicroBatch
from hybrid3d.ds_internals import pipeline_module_uses_grid
from hybrid3d.ds_internals.durable_save import record_saves, snapshot_saves
from hybrid3d.ds_internals.experts import engine_sees_experts
from hybrid3d.ds_internals.muon_import import import_muon_lazily
from hybrid3d.ds_internals.op_build_arch import make_arch_list_readable_for_op_builds
from hybrid3d.ds_internals.pipeline_clip import use_exact_clipping
from hybrid3d.ds_internals.process_groups import new_groups_wait
from hybrid3d.ds_internals.zero3 import partitioned_build, used_outside_forward
from hybrid3d.ds_internals.tied_sync import skip_frozen_tied_gradients, tied_weights_synchronised_without_grad
from hybrid3d.model import LlamaSequential, LlamaShape, load_hf_state_dict
from hybrid3d.model.moe import MoEFeedForward, router_summary
from hybrid3d.model.peft_adapter import read_adapter_tensors
from hybrid3d.model.pipe import build_pipeline_module
from hybrid3d.parallel.context_parallel import sequence_shard
from hybrid3d.parallel.groups import ProcessGroups, build_groups
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.tensor_parallel import seed_tensor_parallel_rng
from hybrid3d.parallel.tensor_parallel.layers import weights_loaded_later
from hybrid3d.parallel.tensor_parallel.lora import train_adapters_only
from hybrid3d.parallel.world import process_group_timeout
from hybrid3d.training.compile import compile_blocks
from hybrid3d.training.engines import engine_for
from hybrid3d.config.validation import ValidRun
from hybrid3d.training.expert_bias import start_counting, update_expert_biases

Batch = tuple  # a data.MicroBatch, or (input_ids (b, s), targets (b, s))


class Trainer:
    """A DeepSpeed engine plus what the training loop needs to know about the layout."""

    def __init__(self, engine, config: RunConfig, layout: ParallelLayout, groups: ProcessGroups, shape: LlamaShape,
                 loads_universal: bool = False):
        self.engine = engine
        self.config = config
        self.layout = layout
        self.groups = groups
        self.shape = shape
        self.loads_universal = loads_universal  # the checkpoint it will load is DeepSpeed's universal one
        self.expert_bias_rate = config.hybrid.expert_bias_update_rate  # aux-loss-free balancing (expert_bias.py)
        if self.expert_bias_rate:
            start_counting(self.module)

    @property
    def module(self):
        return self.engine.module

    @property
    def uses_pipeline(self) -> bool:
        return self.layout.pp > 1

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    def close(self) -> None:
        """Release the engine (DeepSpeed's `destroy`: its optimizer's gradient hooks, which live in autograd's C++
        graph and would otherwise keep the engine, its process groups and their threads alive after the run)."""
        self.engine.destroy()

    def _balance_experts(self) -> None:
        """After an optimizer step: the aux-loss-free bias update from that step's token counts (a collective over
        the data-parallel group), when hybrid3d.expert_bias_update_rate asks for it."""
        if self.expert_bias_rate:
            update_expert_biases(self.module, self.expert_bias_rate, self.groups.get_data_parallel_group(),
                                 self.groups.get_data_parallel_world_size())

    def router_metrics(self) -> dict:
        """A MoE model's load-balancing loss and expert loads over the last training step's global batch
        (`moe.router_summary`); {} for a dense model. A collective: every rank calls it after `train_step`.
        The ranks that computed losses (the last stage) contribute their tallies; TP ranks' copies are alike,
        so their duplication cancels in the means and shares."""
        if not self.shape.is_moe:
            return {}
        tally = self.module.loss_fn.take_router_tally()
        if tally is None:
            tally = torch.zeros(2 + self.shape.num_experts, dtype=torch.float32)
        tally = tally.to(self.engine.device)
        dist.all_reduce(tally)
        return router_summary(tally.cpu())

    def train_step(self, micro_batches: Iterator[Batch]) -> float:
        """One optimizer step over GAS micro-batches; the loss averaged over micro-batches and DP."""
        raise NotImplementedError

    def eval_step(self, micro_batches: Iterator[Batch]) -> float:
        """Loss over GAS micro-batches without gradients, averaged over micro-batches and DP."""
        raise NotImplementedError

    def save(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
             save_latest: bool = True, snapshot=None) -> dict:
        """DeepSpeed's checkpoint; with expert parallelism plus each expert-parallel rank's experts
        (checkpoint/experts.py). Returns {path: bytes} of the files this rank wrote, each fsync'ed. `snapshot`
        (checkpoint/host_copy.Snapshot): the engine's files and the expert file are copied into it, to be written
        later (checkpoint/async_save.py), none to disk."""
        self._check_expert_checkpoint()
        written = {}
        with (snapshot_saves(self.engine, snapshot) if snapshot is not None else record_saves(self.engine, written)):
            # LoRA: the adapters only (the frozen base comes from the HF folder at start-up); ZeRO-2 would also
            # store the base's fragments unless told (deepspeed 0.19.8 engine.py:5301)
            self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                        exclude_frozen_parameters=self.shape.lora_rank > 0)
        if self.layout.ep > 1:
            tag_dir = Path(save_dir) / (tag or f"global_step{self.engine.global_steps}")
            if self.groups.get_data_parallel_rank() < self.layout.ep:  # expert-data-parallel rank 0
                written.update(save_experts(self.module, tag_dir, self.groups.expert_parallel().rank,
                                            self.groups.get_model_parallel_rank(), snapshot))
            dist.barrier()
        return written

    def load(self, load_dir: str, tag: Optional[str] = None, module_only: Optional[bool] = None, **kwargs) -> dict:
        """Load a checkpoint. `module_only` (None: detect it) loads the weights alone, keeping the
        fresh optimizer, scheduler and step count: what a converted HF model (hf2hybrid) holds."""
        self._check_expert_checkpoint()
        if module_only is None:
            module_only = self._is_module_only(Path(load_dir), tag)
        if module_only:
            kwargs.update(load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False)
        if self.layout.ep > 1 or self.shape.lora_rank:  # data rank 0's experts only; LoRA's adapters only
            kwargs["load_module_strict"] = False
        with tied_weights_synchronised_without_grad():  # a pipeline broadcasts tied weights after loading
            loaded, client_state = self.engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if self.layout.ep > 1 and loaded is not None:
            load_experts(self.module, Path(loaded).parent, self.groups.expert_parallel().rank,
                         self.groups.get_model_parallel_rank())  # `loaded`: the tag's model-states file
        return client_state or {}

    def _check_expert_checkpoint(self) -> None:
        check_expert_checkpoints(self.layout.ep, self.layout.pp,
                                 universal=self.loads_universal)

    def _is_module_only(self, load_dir: Path, tag: Optional[str]) -> bool:
        """The tag's hybrid3d.json says so; without one, a ZeRO checkpoint lacking `*optim_states.pt`
        files is weights only (without ZeRO the optimizer state sits in the model files instead)."""
        if tag is None:
            latest = load_dir / "latest"
            if not latest.is_file():
                return False  # DeepSpeed reports the missing tag
            tag = latest.read_text().strip()
        meta = read_meta(load_dir / tag)
        if meta is not None:
            return is_module_only(meta)
        return self.engine.zero_optimization() and not any((load_dir / tag).glob("*optim_states.pt"))


def engine_batch(batch, cp) -> tuple:
    """A MicroBatch (or a plain (ids, targets) pair) as DeepSpeed's (inputs, labels), with this rank's s/c positions
    of ids and targets: inputs = ids, or (ids, positions) with document masking (the whole sequence's positions:
    attention sees every position after the context-parallel exchange); labels = targets, or (targets, weight)."""
    batch = MicroBatch(*batch)
    ids, targets = sequence_shard(batch.ids, cp), sequence_shard(batch.targets, cp)
    inputs = ids if batch.positions is None else (ids, batch.positions)
    labels = targets if batch.loss_weight is None else (targets, batch.loss_weight)
    return inputs, labels


class PipelineTrainer(Trainer):
    """The first stage reads the inputs of each micro-batch, the last its labels (`engine_batch`)."""

    def _shards(self, micro_batches):
        cp = self.groups.context_parallel()
        return (engine_batch(b, cp) for b in micro_batches)

    def train_step(self, micro_batches):
        loss = float(self.engine.train_batch(data_iter=self._shards(micro_batches)))
        self._balance_experts()
        return loss

    def eval_step(self, micro_batches):
        return float(self.engine.eval_batch(data_iter=self._shards(micro_batches)))


class DataParallelTrainer(Trainer):
    def _dp_mean(self, losses) -> float:
        """The mean over micro-batches and over DeepSpeed's d·c data-parallel ranks (the c ranks of a CP
        group hold the same value: their sequences' mean)."""
        loss = torch.stack(losses).float().mean()
        ranks = self.groups.get_data_parallel_world_size()
        if ranks > 1:
            dist.all_reduce(loss, group=self.groups.get_data_parallel_group())
            loss /= ranks
        return loss.item()

    def _to_device(self, tensor):
        """Host batch -> the engine's device: pinned and asynchronous on an accelerator (the copy
        overlaps the previous micro-batch's kernels); a no-op on the CPU."""
        device = self.engine.device
        if torch.device(device).type == "cpu":
            return tensor
        return tensor.pin_memory().to(device, non_blocking=True)

    def _inputs(self, batch):
        """(inputs, labels) of the micro-batch (`engine_batch`), on the engine's device."""
        inputs, labels = engine_batch(batch, self.groups.context_parallel())
        move = (lambda x: tuple(map(self._to_device, x)) if isinstance(x, tuple) else self._to_device(x))
        return move(inputs), move(labels)

    def train_step(self, micro_batches):
        losses = []
        for _ in range(self.engine.gradient_accumulation_steps()):
            inputs, labels = self._inputs(next(micro_batches))
            loss = self.module.loss_fn(self.engine(inputs), labels)
            self.engine.backward(loss)  # scales by 1/GAS; reduces gradients over DP at the boundary
            self.engine.step()  # steps the optimizer only at the accumulation boundary
            losses.append(loss.detach())
        self._balance_experts()
        return self._dp_mean(losses)

    def eval_step(self, micro_batches):
        losses = []
        self.engine.eval()
        with torch.no_grad():
            for _ in range(self.engine.gradient_accumulation_steps()):
                inputs, labels = self._inputs(next(micro_batches))
                losses.append(self.module.loss_fn(self.engine(inputs), labels))
        self.engine.train()
        return self._dp_mean(losses)


def configure_activation_checkpointing(groups: ProcessGroups, config: RunConfig) -> None:
    """Apply the JSON `activation_checkpointing` section (DeepSpeed parses but never applies it)."""
    ds_checkpointing.configure(groups, deepspeed_config=config.ds_config)


def build_trainer(run: ValidRun, hf_state_dict: Optional[dict] = None, load_universal: bool = False,
                  checkpoint_follows: bool = False) -> Trainer:
    """Build groups and model, load HF weights if given, initialise DeepSpeed.

    Every rank must call it (it creates process groups). `run` is what `validate_run` returned: every check
    ran there, once, before anything is built. `load_universal`: the checkpoint this trainer will load is
    DeepSpeed's universal one (a resume at another layout), which its engine must know at initialisation.
    Initial weights are drawn only when nothing overwrites them: not with `hf_state_dict`, nor when the caller
    loads a checkpoint next (`checkpoint_follows`).
    """
    config, layout, shape = run.config, run.layout, run.shape  # build_groups checks the world's size
    config = config.for_engine(load_universal)
    with new_groups_wait(process_group_timeout(config.hybrid.timeout_seconds)):  # every group DeepSpeed makes too
        return _build(config, layout, shape, hf_state_dict, hf_state_dict is None and not checkpoint_follows,
                      load_universal)


def _build(config: RunConfig, layout: ParallelLayout, shape: LlamaShape, hf_state_dict: Optional[dict],
           draw_weights: bool, load_universal: bool) -> Trainer:
    groups = build_groups(layout)
    tp, cp = groups.tensor_parallel(), groups.context_parallel()
    if shape.is_moe and layout.pp > 1:
        # DeepSpeed's pipe/grad partitioning (on by default with TP) splits only outputs[0] of the (hidden,
        # router_stats) tuple; with it on, TP2 x PP2 stops on an AssertionError in PipelineEngine (measured).
        turn_off_pipe_partitioning(config.ds_config, "a mixture-of-experts model (router statistics between stages)")
    seed = config.hybrid.seed
    seed_tensor_parallel_rng(seed, tp.rank + tp.size * cp.rank)  # one stream per (TP, CP) rank: their heads differ
    configure_activation_checkpointing(groups, config)
    with contextlib.nullcontext() if draw_weights else weights_loaded_later(), \
            partitioned_build(config.ds_config, groups, enabled=config.zero_stage == 3):
        module = _build_module(config, layout, shape, groups, seed)
    if shape.tie_word_embeddings and layout.pp == 1:  # the tied head reads the embedding's weight (ZeRO-3)
        used_outside_forward(module, module.layers[0].weight)
    if hf_state_dict is not None:
        load_hf_state_dict(module, hf_state_dict, shape, tp)  # raises on any parameter it did not fill
    if shape.lora_rank:
        if config.hybrid.lora.adapter is not None:  # PEFT's adapter to start from (a checkpoint overwrites it)
            load_hf_state_dict(module, read_adapter_tensors(config.hybrid.lora.adapter, shape), shape, tp, adapters=True)
        train_adapters_only(module)
        if layout.pp > 1:
            skip_frozen_tied_gradients(module)

    compile_blocks(module, config.hybrid.compile)  # opt-in; in place, so names and checkpoints are unchanged

    # DeepSpeed stores this attribute in every checkpoint; ds_to_universal reads it to reshard.
    module.universal_checkpoint_info = universal_checkpoint_info(shape, layout.tp)

    choice = engine_for(layout.pp > 1, config.hybrid.pipeline_schedule, config.hybrid.pipeline_zero2, shape.is_moe,
                        config.hybrid.pipeline_zero2_deferred_fraction)
    parameters = [p for p in module.parameters() if p.requires_grad]
    experts = contextlib.nullcontext()
    if layout.ep > 1:  # expert parameters in their own groups, partitioned by ZeRO over expert data parallelism
        parameters = split_params_into_different_moe_groups_for_optimizer({"params": parameters, "name": "dense"})
        experts = engine_sees_experts(MoEFeedForward)  # has_moe_layers (ds_internals/experts.py)
    import_muon_lazily()  # which DeepSpeed's optimizer set-up imports: its torch.compile calls at first use only
    arch_note = make_arch_list_readable_for_op_builds()  # before FusedAdam's JIT build (op_build_arch.py)
    if arch_note and dist.get_rank() == 0:
        print(arch_note, flush=True)
    with experts:
        engine, _, _, _ = choice.initialize(
            model=module,
            model_parameters=parameters,
            config=config.ds_config,
            mpu=None if layout.pp > 1 else groups,  # the PipelineModule carries its own grid
        )
    if layout.pp > 1:  # the fp32, ZeRO-0 path's clipping miscounts pipeline gradients (pipeline_clip.py)
        use_exact_clipping(engine, groups)
    trainer_cls = PipelineTrainer if layout.pp > 1 else DataParallelTrainer
    return trainer_cls(engine, config, layout, groups, shape, load_universal)


def _build_module(config: RunConfig, layout: ParallelLayout, shape: LlamaShape, groups, seed: int):
    """The PipelineModule of this rank's stage (pp > 1), or the whole model as one sequence of layers."""
    tp, cp, ep = groups.tensor_parallel(), groups.context_parallel(), groups.expert_parallel()
    if layout.pp > 1:
        with pipeline_module_uses_grid(groups.grid), tied_weights_synchronised_without_grad():
            return build_pipeline_module(shape, layout, tp, seed=seed, partition_method=config.hybrid.partition_method,
                                         cp=cp, schedule=config.hybrid.pipeline_schedule,
                                         virtual=config.hybrid.virtual_pipeline_size, ep=ep)
    checkpoint_fn = ds_checkpointing.checkpoint if config.use_reentrant else ds_checkpointing.non_reentrant_checkpoint
    return LlamaSequential(shape, tp, seed=seed, checkpoint_interval=config.checkpoint_interval,
                           checkpoint_fn=checkpoint_fn, cp=cp, ep=ep)

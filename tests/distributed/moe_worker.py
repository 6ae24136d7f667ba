"""A tiny Mixtral, its Hugging Face reference run, and the rank side of the MoE training tests.

The reference trains `MixtralForCausalLM` (transformers' eager expert loop) with torch AdamW on the same
micro-batches hybrid3d's ranks see: the load-balancing loss is not additive over tokens (it multiplies two
means over the batch), so the reference takes each micro-batch's loss, CE + coef · aux, on that micro-batch
alone, as every rank does, and averages the micro-batches' gradients as DeepSpeed does over GAS and DP.
"""

import contextlib
import gc
import math
import os

import torch
import torch.nn.functional as F

from tests.distributed.async_saves import save_both_ways
from tests.distributed.worlds import each_run
from tests.distributed.engine_runs import GLOBAL_BATCH, MICRO_BATCH, STEPS, global_batch, micro_batches
from tests.tiny_mixtral import load_mixtral

# As tests/unit/test_moe_model.py: Adam divides by sqrt(v) + eps, and a gradient element that cancels to ~1e-9
# turns fp32 rounding into a visible step at eps 1e-8; eps 1e-6 and lr 1e-3 keep that far below the tolerance.
ADAMW = dict(lr=1e-3, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1)
CLIP = 1.0  # below the reference's gradient norms (the test checks that it clips)


@contextlib.contextmanager
def capacity_reference(factor: float):
    """HF's Mixtral block with an expert capacity, written as the rule reads: visiting a micro-batch's n tokens
    in order, each token's k choices in order, an expert takes an assignment while it has taken fewer than
    ceil(factor·n·k/E); a dropped assignment's routing weight becomes 0 (its expert's output adds nothing)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        _, weights, index = self.gate(flat)
        num_experts = self.gate.weight.shape[0]
        capacity = math.ceil(factor * index.numel() / num_experts)
        taken = [0] * num_experts
        keep = torch.zeros(index.shape)
        for token in range(index.shape[0]):
            for slot in range(index.shape[1]):
                expert = int(index[token, slot])
                if taken[expert] < capacity:
                    taken[expert] += 1
                    keep[token, slot] = 1.0
        return self.experts(flat, index, weights * keep).reshape(b, s, h)

    saved = MixtralSparseMoeBlock.forward
    MixtralSparseMoeBlock.forward = forward
    try:
        yield
    finally:
        MixtralSparseMoeBlock.forward = saved


def reference_run(directory, steps: int = STEPS, bias_rate: float = 0.0, micro_batch: int = MICRO_BATCH,
                  **overrides) -> dict:
    """Losses, pre-clipping gradient norms and final weights (HF file names) of HF + torch AdamW. `bias_rate`:
    after every optimizer step each HF router's e_score_correction_bias moves by rate · sign(mean − count) of the
    tokens its `forward` chose for each expert over the step's global batch (aux-loss-free balancing, written
    here from the rule). `micro_batch`: the sequences of each forward (each takes its own load-balancing loss)."""
    from hybrid3d.model.hf_weights import unfuse_hf_experts

    model = load_mixtral(directory, **overrides)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                  weight_decay=ADAMW["weight_decay"])
    # DeepSeek-V3's class adds no load-balancing loss (and reports none)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    chosen = []  # (router, its choices (n, k)) per layer and micro-batch: HF's routers return the choices third
    hooks = [m.register_forward_hook(lambda router, _i, out: chosen.append((router, out[2])))
             for name, m in model.named_modules() if name.endswith("mlp.gate") and not isinstance(m, torch.nn.Linear)]
    num_experts = next(m for n, m in model.named_modules() if n.endswith("mlp.gate")).weight.shape[0]
    losses, norms, aux, loads = [], [], [], []
    for step in range(steps):
        ids, targets = global_batch(step)
        micro = list(zip(ids.split(micro_batch), targets.split(micro_batch)))
        step_losses, step_aux = [], []
        chosen.clear()
        for mb_ids, mb_targets in micro:
            out = model(mb_ids, output_router_logits=True)
            loss = F.cross_entropy(out.logits.flatten(0, 1), mb_targets.flatten())
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + coef * out.aux_loss
                step_aux.append(out.aux_loss.item())
            (loss / len(micro)).backward()
            step_losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / len(step_losses))
        aux.append(sum(step_aux) / len(step_aux) if step_aux else None)
        if bias_rate:
            with torch.no_grad():
                for router in {router for router, _ in chosen}:
                    mine = torch.cat([c.flatten() for r, c in chosen if r is router])
                    layer = torch.bincount(mine, minlength=num_experts).float()
                    router.e_score_correction_bias += bias_rate * torch.sign(layer.mean() - layer)
        counts = torch.bincount(torch.cat([c.flatten() for _, c in chosen]), minlength=num_experts)
        loads.append((counts / counts.sum()).tolist())  # each expert's share of the step's assignments
    for hook in hooks:
        hook.remove()
    state = dict(model.state_dict())
    weights = {n: t.detach().clone() for n, t in unfuse_hf_experts(state, model.config.model_type).items()}
    return {"losses": losses, "norms": norms, "weights": weights, "aux": aux, "expert_load": loads}


def ds_config(tp: int, pp: int, ep: int, zero: int, capacity=None, bias_rate: float = 0.0, kernel=None,
              bf16: bool = False, lr: float = ADAMW["lr"], hybrid=None, micro_batch: int = MICRO_BATCH,
              **extra) -> dict:
    if bf16:  # bf16 weights, fp32 masters and gradient accumulation: the planner's precision for ZeRO-1/2
        extra = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, **extra}
    return {**extra,
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "lr": lr, "torch_adam": True}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**6,
        "comms_logger": {"enabled": True, "prof_all": False},  # switched on for the last step (`run_one`)
        "hybrid3d": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep,
                     "expert_capacity_factor": capacity, "expert_bias_update_rate": bias_rate,
                     "expert_kernel": kernel, **(hybrid or {})},
    }


def run_one(run: dict, model_dir: str) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.model import LlamaShape
    from hybrid3d.model.hf_weights import gather_hf_state_dict
    from hybrid3d.model.moe import Experts
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    if run.get("family"):  # another MoE family's model, beside the Mixtral (test_moe.py's `results`)
        model_dir = os.path.join(os.path.dirname(model_dir), run["family"])
    hf = load_mixtral(model_dir)
    shape = LlamaShape.from_hf(hf.config)
    hf_state = hf.state_dict()

    def build():
        config = ds_config(run["tp"], run["pp"], run["ep"], run["zero"], run.get("capacity"), run.get("bias_rate", 0.0),
                           run.get("kernel"), run.get("bf16", False), run.get("lr", ADAMW["lr"]), run.get("hybrid"),
                           run.get("micro_batch", MICRO_BATCH), **run.get("extra", {}))
        return build_trainer(validate_run(config, dist.get_world_size(), shape), hf_state_dict=hf_state)

    trainer = build()
    dp_rank, dp = trainer.groups.data_shard()
    from deepspeed.comm import comms_logger

    from tests.distributed.sequence_worker import comm_bytes_by_caller

    losses, norms, routing = [], [], []
    for step in range(STEPS):
        if step == STEPS - 1:  # log the last step's collectives: its all-to-all bytes against the traffic model
            comms_logger.comms_dict.clear()
            comms_logger.enabled = comms_logger.prof_all = True
        if step == run.get("resume_at"):  # save, then continue in a fresh trainer from the checkpoint
            save_dir = os.path.join(os.path.dirname(model_dir), f"ckpt-{run['name']}")
            async_files = save_both_ways(trainer, save_dir, "mid")
            del trainer
            gc.collect()
            trainer = build()  # starts from the HF weights and a fresh optimizer: all must come from the files
            trainer.load(save_dir, tag="mid")  # the asynchronous save's files
            assert trainer.global_steps == step
        losses.append(trainer.train_step(micro_batches(step, dp_rank, dp, trainer.config.micro_batch_size)))
        norms.append(float(trainer.engine.get_global_grad_norm()))
        comms_logger.enabled = comms_logger.prof_all = False
        routing.append(trainer.router_metrics())
    if run.get("resume_at") is not None:  # the final weights, for export and `hybrid3d.verify`
        trainer.save(os.path.join(os.path.dirname(model_dir), f"ckpt-{run['name']}"), tag="final")
    del hf, hf_state
    engine = trainer.engine
    if run.get("bf16"):  # report the fp32 masters (every rank takes part in each gather)
        from deepspeed.utils import safe_get_full_fp32_param

        masters = [safe_get_full_fp32_param(p) for p in trainer.module.parameters()]
        for p, master in zip(trainer.module.parameters(), masters):
            p.data = master
    report = {
        "losses": losses,
        "norms": norms,
        "routing": routing,
        "all_to_all_bytes": sum(size for (op, _), size in comm_bytes_by_caller(comms_logger.comms_dict).items()
                                if op == "all_to_all_single"),
        "weights": {k: v.float().cpu() for k, v in gather_hf_state_dict(
            trainer.module, trainer.shape, trainer.groups.tensor_parallel()).items()},
        "experts": sorted({tuple(int(e) for e, _ in m.named_children()) for m in trainer.module.modules()
                           if isinstance(m, Experts)}),
        "kernels": sorted({m.kernel(torch.float32)[0] for m in trainer.module.modules() if isinstance(m, Experts)}),
        "has_moe_layers": engine.has_moe_layers,
        "optimizer": type(engine.optimizer).__name__,
        # the expert parameters of each ZeRO group DeepSpeed partitions over expert data parallelism
        "moe_groups": [len(group) for group, moe in zip(engine.optimizer.bit16_groups,
                                                        getattr(engine.optimizer, "is_moe_param_group", [])) if moe]
        if run["zero"] and hasattr(engine.optimizer, "bit16_groups") else None,  # BF16_Optimizer has its own
        "stage": trainer.groups.stage_id,
        "pipe_partitioned": trainer.config.ds_config.get("pipeline", {}).get("pipe_partitioned"),
        "ep_rank": trainer.groups.expert_parallel().rank,
        "async_files": async_files if run.get("resume_at") is not None else None,
    }
    dist.barrier()
    del trainer, engine
    gc.collect()
    return report


def moe_runs(rank, world_size, runs, model_dir):
    reports = each_run(runs, lambda run: run_one(run, model_dir))
    if world_size == 2:
        reports["verify"] = verify_checkpoints(rank, model_dir)  # after the runs: it needs their checkpoints
    return reports


def verify_checkpoints(rank: int, model_dir: str) -> dict:
    """`hybrid3d.verify` exit codes: a converted TP2 checkpoint and the EP2 run's final checkpoint against their HF
    models (0 expected), and the trained checkpoint against the untrained model (1 expected)."""
    import deepspeed.comm as dist

    from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
    from hybrid3d.convert.verify import main as verify_main

    root = os.path.dirname(model_dir)
    converted, trained, exported = (os.path.join(root, n) for n in ("converted-tp2", "ckpt-EP2-DP2-Z2-resume", "hf-ep2"))
    if rank == 0:
        hf_to_hybrid(model_dir, converted, tp=2, pp=1)
        hybrid_to_hf(trained, exported, tag="final", hf_config_dir=model_dir)  # the expert files merged back
    dist.barrier()
    runs = {"converted-tp2": (model_dir, converted, None), "ep2-trained": (exported, trained, "final"),
            "ep2-vs-untrained": (model_dir, trained, "final")}
    out = {}
    for name, (hf_dir, checkpoint, tag) in runs.items():
        argv = ["--hf-model", hf_dir, "--checkpoint", checkpoint] + (["--tag", tag] if tag else [])
        out[name] = verify_main(argv)
    return out

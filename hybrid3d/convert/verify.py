"""`python -m hybrid3d.verify --hf-model DIR --checkpoint DIR`: does a hybrid checkpoint compute
what its Hugging Face original computes?

A checkpoint of tp * pp = 1 runs as a plain process; others run under the launcher (`deepspeed --num_gpus N
--module hybrid3d.verify ...`) with N a multiple of the checkpoint's tp * pp (the rest is data parallel). It
loads the checkpoint into the TP model at the layout it was saved in, runs one random token batch through it
and through HF's `LlamaForCausalLM` / `MixtralForCausalLM` (fp32; a Mixtral's loss includes
router_aux_loss_coef times its load-balancing loss on both sides), and prints the largest logit difference
(absolute, and relative to the largest HF logit), the loss difference and the top-1 agreement. Exit codes: 0
within tolerance, 1 outside it, 2 for a user error.
"""

import argparse
import sys

DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 3e-2}


def build_parser() -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's whole first paragraph
    parser = argparse.ArgumentParser(prog="python -m hybrid3d.verify", description=summary)
    parser.add_argument("--hf-model", required=True, help="the HF model folder (the reference)")
    parser.add_argument("--checkpoint", required=True, help="hybrid3d/DeepSpeed checkpoint folder")
    parser.add_argument("--tag", help="checkpoint tag (default: the one in `latest`)")
    parser.add_argument("--dtype", choices=sorted(DEFAULT_RTOL), default="fp32", help="hybrid model compute dtype")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: 1e-5 fp32, 3e-2 bf16)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token batch")
    parser.add_argument("--vocab-pad-multiple", type=int,
                        help="the trainer's hybrid3d.vocab_pad_multiple (default: stored in the checkpoint, else 128)")
    parser.add_argument("--verbose", action="store_true", help="show DeepSpeed's own log lines and prints")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from hybrid3d.errors import UserError

    try:
        return _verify(args)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _verify(args) -> int:
    import deepspeed.comm as dist
    import torch
    import torch.nn.functional as F

    from hybrid3d.convert.hybrid_source import HybridCheckpoint
    from hybrid3d.model.config import LlamaShape
    from hybrid3d.model.hf_source import read_hf_config
    from hybrid3d.errors import UserError
    from hybrid3d.parallel.layout import ParallelLayout
    from hybrid3d.parallel.standalone import launch_hint, launched, use_single_process_world
    from hybrid3d.parallel.world import start_world
    from hybrid3d.training.console import deepspeed_prints, hold_back_deprecated_alias_warnings, set_deepspeed_verbosity
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.run_config import forward_only_config
    from hybrid3d.config.validation import validate_run

    hold_back_deprecated_alias_warnings()
    set_deepspeed_verbosity(args.verbose)

    checkpoint = HybridCheckpoint.open(args.checkpoint, args.tag)
    if not launched() and checkpoint.tp * checkpoint.pp > 1:
        raise UserError(launch_hint(checkpoint.tp * checkpoint.pp, f"{args.checkpoint} (tp {checkpoint.tp} x pp "
                                    f"{checkpoint.pp})", "--module hybrid3d.verify --hf-model ... --checkpoint ..."))
    use_single_process_world()
    config = read_hf_config(args.hf_model)
    pad = args.vocab_pad_multiple or checkpoint.section.get("vocab_pad_multiple", 128)
    shape = LlamaShape.from_hf(config, vocab_pad_multiple=pad)
    if not dist.is_initialized():
        with deepspeed_prints(args.verbose):  # its op builds and topology lines, per rank
            start_world()  # this rank's device first
    layout = ParallelLayout.for_world(dist.get_world_size(), checkpoint.tp, checkpoint.pp)
    ep = checkpoint.expert_parallel_size
    ds_config = forward_only_config(args.batch_size, layout.tp, layout.pp, pad, ep, bf16=args.dtype == "bf16")
    with deepspeed_prints(args.verbose):  # PipelineModule's layer listing, the optimizer's lines, per rank
        trainer = build_trainer(validate_run(ds_config, dist.get_world_size(), shape), checkpoint_follows=True)
        trainer.load(args.checkpoint, tag=args.tag, module_only=True)

    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, shape.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
    ids, targets = tokens[:, :-1], tokens[:, 1:]  # (b, s) each
    logits, loss = hybrid_logits_and_loss(trainer, ids, targets)

    reporter = layout.topology().get_rank(pipe=layout.pp - 1, data=0, model=0)
    passed = None
    if dist.get_rank() == reporter:
        hf = _hf_model(args.hf_model)
        with torch.no_grad():
            out = hf(ids, output_router_logits=True) if shape.is_moe else hf(ids)
            ref = out.logits.float()  # (b, s, V)
            ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten())
            if shape.is_moe:  # the hybrid loss includes the load-balancing term, as HF's with router logits does
                ref_loss = ref_loss + shape.router_aux_loss_coef * out.aux_loss
        passed = report(logits.float(), loss, ref, ref_loss, layout, args)
    return 0 if broadcast_verdict(passed, reporter) else 1


def broadcast_verdict(passed, reporter: int) -> bool:
    """The reporter's pass/fail on every rank (`passed` is None elsewhere)."""
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    verdict = torch.zeros(1, device=get_accelerator().current_device_name())  # NCCL takes device tensors only
    if passed is not None:
        verdict.fill_(1.0 if passed else 0.0)
    dist.broadcast(verdict, src=reporter)
    return verdict.item() == 1.0


def hybrid_logits_and_loss(trainer, ids, targets):
    """Full logits (b, s, V) and the loss on the last stage's TP rank 0, (None, None) elsewhere."""
    import torch

    from hybrid3d.model.llama import gather_vocab_logits
    from hybrid3d.model.activations import split_activations

    tp = trainer.groups.tensor_parallel()
    vocab = trainer.shape.vocab_size
    if trainer.uses_pipeline:
        loss, local = trainer.engine.eval_batch(iter([(ids, targets)]), return_logits=True)
        if not trainer.engine.is_last_stage():
            return None, None
    else:
        with torch.no_grad():
            local = trainer.module(ids.to(trainer.engine.device))  # (b, s, V_padded/t)
            loss = trainer.module.loss_fn(local, targets.to(trainer.engine.device))
    local, _, _ = split_activations(local)  # a MoE model's outputs are (logits, router_stats)
    with torch.no_grad():
        logits = gather_vocab_logits(local, tp, vocab).cpu()  # (b, s, V)
    return (logits, float(loss)) if tp.rank == 0 else (None, None)


def report(logits, loss: float, ref, ref_loss, layout, args) -> bool:
    diff = (logits - ref).abs().max().item()
    rel = diff / ref.abs().max().item()
    ref_loss = ref_loss.item()
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[args.dtype]
    passed = rel <= rtol and loss_rel <= rtol
    print(f"verify {args.checkpoint} at {layout.name} ({args.dtype}) against {args.hf_model} "
          f"on {args.batch_size}x{args.seq_len} random tokens (seed {args.seed}):")
    print(f"  max |logit diff| {diff:.3e}, relative {rel:.3e}")
    print(f"  loss {loss:.6f} vs HF {ref_loss:.6f}, relative diff {loss_rel:.3e}")
    print(f"  top-1 agreement {100 * top1:.2f}%")
    print(f"{'PASS' if passed else 'FAIL'}: relative tolerance {rtol:g}", flush=True)
    return passed


def _hf_model(directory):
    """The HF class the folder's config names (LlamaForCausalLM or MixtralForCausalLM), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


if __name__ == "__main__":
    sys.exit(main())

"""The mixture-of-experts Llama (Mixtral) against Hugging Face `MixtralForCausalLM`, fp32, one process (TP 1).

HF's loss with `output_router_logits=True` is cross entropy + router_aux_loss_coef · aux, aux from
`load_balancing_loss_func` over all layers' router logits; ours carries the routing statistics through
the blocks (hybrid3d/model/moe.py). HF shifts `labels` inside; our targets are the ids shifted by one
with the last position ignored, the same tokens.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hybrid3d.config.run_config import parse_config
from hybrid3d.errors import ConfigError, LayoutError, UnsupportedConfigError, UserError
from hybrid3d.model import LlamaSequential, LlamaShape, gather_vocab_logits, load_hf_state_dict
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import gather_hf_state_dict, unfuse_hf_experts
from hybrid3d.model.moe import load_balancing_loss
from hybrid3d.config.support import check_experts, check_moe_options
from hybrid3d.model.tp_plan import check_split
from hybrid3d.parallel.tensor_parallel import IGNORE_INDEX
from hybrid3d.parallel.rank_groups import TensorParallelGroup

TINY = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
            max_position_embeddings=128, rms_norm_eps=1e-5)
E, K = TINY["num_local_experts"], TINY["num_experts_per_tok"]
TP1 = TensorParallelGroup.single()
# Measured on this 2-core CPU (max over seeds 3, 5, 7 for training): logits, loss and aux equal HF's bit
# for bit (the same fp32 ops in the same order); gradients differ by <= 6e-8 (attention's backward sums
# in another order); losses over 5 AdamW steps by <= 3e-7 relative, weights by <= 2.7e-6. The effects
# checked are far larger: coef · aux = 0.04 in the loss, weights move by ~5e-3 in 5 steps.
TOL = 1e-5  # logits, weights after training (absolute)
GRAD_TOL = 1e-6
LOSS_RTOL = 1e-6
# Adam divides by sqrt(v) + eps: a gradient element that cancels to ~1e-9 makes fp32 rounding (1e-10)
# a 5% change of its step, lr · 5e-2 at eps 1e-8. eps 1e-6 and lr 1e-3 keep that far below TOL.
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_hf(seed: int = 0, **overrides) -> MixtralForCausalLM:
    """A random tiny Mixtral with the reference (eager) expert loop; norms and routers made non-trivial."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM._from_config(MixtralConfig(**{**TINY, **overrides}), experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # decisive routing instead of near-uniform probabilities
                p.normal_(0.0, 0.3)
    return model


def ours_from(hf: MixtralForCausalLM, **kw) -> LlamaSequential:
    shape = LlamaShape.from_hf(hf.config)
    model = LlamaSequential(shape, TP1, **kw)
    load_hf_state_dict(model, hf.state_dict(), shape, TP1)
    return model


def batch(seed: int = 1, b: int = 2, s: int = 16):
    """ids (b, s) and our targets: ids shifted left, the last position ignored (HF pads it so too)."""
    ids = torch.randint(0, TINY["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))
    return ids, F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def max_diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys()
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def test_mixtral_shape_from_hf():
    shape = LlamaShape.from_hf(MixtralConfig(**TINY))
    assert (shape.num_experts, shape.experts_per_token, shape.router_aux_loss_coef) == (4, 2, 0.02)
    assert shape.is_moe and not LlamaShape.from_hf(MixtralConfig(**{**TINY, "num_local_experts": 0})).is_moe
    assert LlamaShape.from_hf(MixtralConfig(**TINY, sliding_window=128)).num_experts == 4  # window covers all positions


@pytest.mark.parametrize("field, overrides", [("sliding_window", dict(sliding_window=64)),
                                               ("router_jitter_noise", dict(router_jitter_noise=0.01)),
                                               ("num_experts_per_tok", dict(num_experts_per_tok=5))])
def test_mixtral_config_refusals(field, overrides):
    with pytest.raises(UnsupportedConfigError) as error:
        LlamaShape.from_hf(MixtralConfig(**{**TINY, **overrides}))
    message = str(error.value)
    assert field in message and "\n" not in message


def test_moe_refuses_untested_layouts():
    shape = LlamaShape.from_hf(MixtralConfig(**TINY))
    check_split(shape, 1, 1, 1)
    check_experts(shape.num_experts, 1, 1, 1, 1)
    for t, pp, cp, ep in ((4, 1, 1, 1), (1, 1, 2, 1), (2, 2, 1, 2), (1, 1, 1, 4)):
        check_split(shape, t, pp, cp, ep)  # the arithmetic allows them: the support table refuses them
        with pytest.raises(LayoutError, match="num_local_experts") as error:
            check_experts(shape.num_experts, t, pp, cp, ep)
        assert "\n" not in str(error.value)
    with pytest.raises(LayoutError, match="not divisible by expert_parallel_size"):
        check_split(LlamaShape.from_hf(MixtralConfig(**{**TINY, "num_local_experts": 3})), 1, 1, 1, 2)
    with pytest.raises(LayoutError, match="expert_parallel_size"):  # a dense model has no experts to split
        check_split(LlamaShape.from_hf(MixtralConfig(**{**TINY, "num_local_experts": 0})), 1, 1, 1, 2)


def test_mixtral_forward_matches_hf():
    hf = make_hf()
    model = ours_from(hf)
    ids, targets = batch()
    ref = hf(ids, labels=ids, output_router_logits=True)
    logits, router_stats = model(ids)
    loss = model.loss_fn((logits, router_stats), targets)
    aux = load_balancing_loss(router_stats, E)

    assert (gather_vocab_logits(logits, TP1, TINY["vocab_size"]) - ref.logits).abs().max() <= TOL
    hf_aux = load_balancing_loss_func(ref.router_logits, E, K)  # attention_mask None: every token counts
    assert torch.allclose(aux, hf_aux, rtol=LOSS_RTOL, atol=0) and torch.allclose(aux, ref.aux_loss, rtol=LOSS_RTOL, atol=0)
    assert torch.allclose(loss, ref.loss, rtol=LOSS_RTOL, atol=0)
    lm_only = F.cross_entropy(ref.logits.flatten(0, 1), targets.flatten())
    assert (ref.loss - lm_only).item() == pytest.approx(0.02 * aux.item(), rel=1e-4)  # HF's loss includes coef·aux
    assert router_stats[:E].sum().item() == K * ids.numel() * TINY["num_hidden_layers"]  # every token, k experts

    ref.loss.backward()
    loss.backward()
    hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()})
    assert max_diff(gather_hf_state_dict(model, model.shape, TP1, grads=True), hf_grads) <= GRAD_TOL


def test_mixtral_trains_like_hf():
    hf = make_hf(seed=3)
    model = ours_from(hf)
    ids, targets = batch(seed=4)
    opts = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (hf, model)]
    for _ in range(5):
        for opt in opts:
            opt.zero_grad()
        ref = hf(ids, labels=ids, output_router_logits=True).loss
        loss = model.loss(ids, targets)
        assert torch.allclose(loss, ref, rtol=LOSS_RTOL, atol=0)
        ref.backward()
        loss.backward()
        for opt in opts:
            opt.step()
    ours = gather_hf_state_dict(model, model.shape, TP1)
    reference = {n: t.detach() for n, t in unfuse_hf_experts(hf.state_dict()).items()}
    assert max_diff(ours, reference) <= TOL
    # the weights did move, by much more than the tolerance
    assert max_diff(ours, {n: t.detach() for n, t in unfuse_hf_experts(make_hf(seed=3).state_dict()).items()}) > 1e-3


def test_aux_loss_gradient_reaches_the_router():
    ids, targets = batch()
    grads = {}
    for coef in (0.0, 0.02):
        model = ours_from(make_hf(router_aux_loss_coef=coef))
        model.loss(ids, targets).backward()
        grads[coef] = torch.stack([model.get_parameter(f"{i}.mlp.router.weight").grad for i in (1, 2)])
    model = ours_from(make_hf())
    load_balancing_loss(model(ids)[1], E).backward()  # the aux term alone
    aux_grad = torch.stack([model.get_parameter(f"{i}.mlp.router.weight").grad for i in (1, 2)])
    assert (grads[0.02] - grads[0.0]).abs().max() > 1e-4
    assert (grads[0.02] - grads[0.0] - 0.02 * aux_grad).abs().max() <= 1e-7


def test_moe_activation_checkpointing_carries_router_stats():
    hf = make_hf()
    ids, targets = batch()
    plain = ours_from(hf)
    chunked = ours_from(hf, checkpoint_interval=1, checkpoint_fn=lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    for model in (plain, chunked):
        model.loss(ids, targets).backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, chunked)]
    assert max_diff(grads[1], grads[0]) <= 1e-7


def test_mixtral_loads_from_checkpoint_files(tmp_path):
    """Files name experts one tensor each (`block_sparse_moe.experts.<e>.w1.weight`); a transformers 5
    module fuses them. Both load the same weights."""
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    source = HFSource.open(tmp_path)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in source
    from_files = LlamaSequential(LlamaShape.from_hf(source.config), TP1)
    load_hf_state_dict(from_files, source, from_files.shape, TP1)
    from_module = ours_from(hf)
    assert max_diff(dict(from_files.state_dict()), dict(from_module.state_dict())) == 0


def test_expert_parallel_config_refusals():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
            "hybrid3d": {"expert_parallel_size": 2}}
    assert parse_config(base, 2).ep == 2
    assert parse_config(dict(base, bf16={"enabled": True}), 2).ep == 2  # bf16: tests/distributed/test_moe.py
    cases = [
        (dict(base, hybrid3d={"expert_parallel_size": 4}), 2, "must divide"),
        (dict(base, zero_optimization={"stage": 0}), 2, "zero_optimization.stage"),
        (dict(base, hybrid3d={"expert_parallel_size": 2, "context_parallel_size": 2}), 4, "context_parallel_size"),
        (dict(base, hybrid3d={"expert_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}), 4,
         "sequence_parallel"),
        (dict(base, fp16={"enabled": True}), 2, "fp16"),
        (dict(base, hybrid3d={"expert_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_zero2": True},
              zero_optimization={"stage": 2}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}), 4,
         "pipeline_zero2"),
    ]
    for raw, world, key in cases:
        with pytest.raises(UserError, match="expert_parallel_size") as error:  # ConfigError, or LayoutError
            parse_config(raw, world)
        assert key in str(error.value) and "\n" not in str(error.value)


def test_moe_option_refusals():
    shape = LlamaShape.from_hf(MixtralConfig(**TINY))
    check_moe_options(shape.is_moe, 2, checkpoint_interval=1, use_reentrant=False)
    check_moe_options(shape.is_moe, 1, checkpoint_interval=1)  # no pipeline: LlamaSequential backpropagates the tuple once
    for schedule in ("dualpipev", "interleaved"):  # tests/distributed/test_moe.py
        check_moe_options(shape.is_moe, 2, schedule=schedule)
    check_moe_options(shape.is_moe, 2, checkpoint_interval=1)  # reentrant under 1F1B's one-backward engine
    for pp, options, key in ((2, dict(checkpoint_interval=1, schedule="dualpipev"), "use_reentrant"),
                             (2, dict(pipeline_zero2=True), "pipeline_zero2"),
                             (1, dict(sequence_parallel=True), "sequence_parallel")):
        with pytest.raises(ConfigError, match=key) as error:
            check_moe_options(shape.is_moe, pp, **options)
        assert "\n" not in str(error.value)
    dense = LlamaShape.from_hf(MixtralConfig(**{**TINY, "num_local_experts": 0}))
    check_moe_options(dense.is_moe, 2, checkpoint_interval=1, schedule="dualpipev", sequence_parallel=True)


def test_checkpoint_records_expert_parallel_size(tmp_path):
    """A checkpoint saved at another expert_parallel_size holds other experts per rank: it is not loaded natively."""
    from hybrid3d.checkpoint.files import write_meta
    from hybrid3d.checkpoint.resume import plan_resume

    tag = tmp_path / "global_step3"
    tag.mkdir()
    write_meta(tag, {"layout": {"tp": 1, "pp": 1, "dp": 2, "cp": 1, "ep": 2, "schedule": "1f1b", "virtual": 1},
                     "shape": {}, "module_only": False})
    assert not plan_resume(str(tag), None, 1, 1, 2, {}, ep=2).universal
    assert plan_resume(str(tag), None, 1, 1, 2, {}, ep=1).universal


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_expert_capacity_drops_like_the_rule(factor):
    """`expert_capacity_factor`: logits, loss and gradients equal HF's block with the capacity rule written as a
    loop (tests/distributed/moe_worker.py `capacity_reference`); assignments were dropped (the output differs
    from the dropless model's by far more than the tolerance); a capacity of every assignment drops nothing."""
    import dataclasses

    from tests.distributed.moe_worker import capacity_reference

    hf = make_hf(seed=5)
    shape = dataclasses.replace(LlamaShape.from_hf(hf.config), expert_capacity_factor=factor)
    model = LlamaSequential(shape, TP1)
    load_hf_state_dict(model, hf.state_dict(), shape, TP1)
    ids, targets = batch(seed=6)
    dropless = hf(ids).logits.detach()
    with capacity_reference(factor):
        ref = hf(ids, labels=ids, output_router_logits=True)
    loss = model.loss(ids, targets)
    logits = gather_vocab_logits(model(ids)[0], TP1, TINY["vocab_size"])
    assert (logits - ref.logits).abs().max() <= TOL
    assert (logits - dropless).abs().max() > 100 * TOL
    assert torch.allclose(loss, ref.loss, rtol=LOSS_RTOL, atol=0)
    ref.loss.backward()
    loss.backward()
    hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()})
    assert max_diff(gather_hf_state_dict(model, model.shape, TP1, grads=True), hf_grads) <= GRAD_TOL

    everything = LlamaSequential(dataclasses.replace(shape, expert_capacity_factor=float(E)), TP1)
    load_hf_state_dict(everything, hf.state_dict(), shape, TP1)
    assert (gather_vocab_logits(everything(ids)[0], TP1, TINY["vocab_size"]) - dropless).abs().max() <= TOL


def test_expert_capacity_config_refusals():
    with pytest.raises(ConfigError, match="expert_capacity_factor"):
        check_moe_options(LlamaShape.from_hf(MixtralConfig(**TINY)).is_moe, 1, capacity_factor=0.0)
    dense = LlamaShape(vocab_size=203, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_moe_options(dense.is_moe, 1, capacity_factor=1.25)

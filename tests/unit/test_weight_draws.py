"""What building a model draws from the random generators (issue: start-up at 7B/8B).

A rank draws only what it keeps: no initial weights at all when HF weights or a checkpoint overwrite them next,
and with expert parallelism only the experts it holds, each from its own seed, so the weights still do not
depend on the expert-parallel size.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig

from hybrid3d.model import LlamaSequential, LlamaShape, load_hf_state_dict
from hybrid3d.model.layers import seed_layer
from hybrid3d.model.moe import Experts
from hybrid3d.parallel.rank_groups import ExpertParallelGroup, TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.layers import weights_loaded_later
from tests.counters import DrawCounter

TP1 = TensorParallelGroup.single()
LLAMA = dict(vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MIXTRAL = dict(vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def test_a_model_whose_weights_are_loaded_next_draws_none_and_loads_every_one():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    shape = LlamaShape.from_hf(hf.config)
    with DrawCounter() as drawn:
        LlamaSequential(shape, TP1, seed=0)
    assert drawn.drawn > sum(p.numel() for p in hf.parameters()) // 2  # the counter sees the ordinary build
    with DrawCounter() as skipped, weights_loaded_later():
        model = LlamaSequential(shape, TP1, seed=0)
    assert skipped.drawn == 0
    load_hf_state_dict(model, hf.state_dict(), shape, TP1)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids)[..., :LLAMA["vocab_size"]], hf(ids).logits)


def test_expert_parallel_ranks_draw_only_their_experts_and_equal_the_whole_layer():
    shape = LlamaShape.from_hf(MixtralConfig(**MIXTRAL))
    seed_layer(3)
    whole = Experts(shape, TP1)
    per_expert = sum(p.numel() for p in whole.get_submodule("0").parameters())
    for rank in range(2):
        ep = ExpertParallelGroup(group=object(), rank=rank, size=2, name="ep_size_2")
        seed_layer(3)
        with DrawCounter() as drawn:
            held = Experts(shape, TP1, ep)
        assert drawn.drawn == 2 * per_expert  # old code drew all 4 experts and dropped two
        names = [name for name, _ in held.named_parameters()]
        assert names and all(name.split(".")[0] in {str(2 * rank), str(2 * rank + 1)} for name in names)
        whole_params = dict(whole.named_parameters())
        for name, param in held.named_parameters():
            assert torch.equal(param, whole_params[name]), name

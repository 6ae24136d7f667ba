"""context_parallel_comm (issue 36) refused in one line naming the key, and ring attention's layout rules (no
process group): the load-balanced chunks and what the heads no longer limit."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from hybrid3d.errors import ConfigError, LayoutError
from hybrid3d.model import LlamaShape
from hybrid3d.model.tp_plan import check_split
from hybrid3d.parallel.rank_groups import ContextParallelGroup
from hybrid3d.parallel.ring_attention import chunk_positions, member_positions, rank_positions
from hybrid3d.config.validation import validate_run
from tests.distributed.engine_runs import ds_config

SIX_HEADS = LlamaShape.from_hf(LlamaConfig(vocab_size=203, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256))


def config(**hybrid) -> dict:
    raw = ds_config(1, 1, 1)
    raw["hybrid3d"].update({"context_parallel_size": 2, **hybrid})
    return raw


def test_refusals_name_the_key():
    cases = [
        (config(context_parallel_comm="ring"), "hybrid3d.context_parallel_comm must be one of a2a, p2p"),
        (config(context_parallel_comm="a2a+p2p"), "context_parallel_a2a_size (1) must divide context_parallel_size (2)"),
        (config(context_parallel_a2a_size=2), "context_parallel_a2a_size applies to context_parallel_comm 'a2a+p2p'"),
        (config(context_parallel_comm="p2p", data={"seq_length": 130}),
         "seq_length (130) is not divisible by context_parallel_size (2) * 2 (ring attention)"),
    ]
    for raw, needle in cases:
        with pytest.raises(ConfigError) as caught:
            validate_run(raw, 2, SIX_HEADS, on_cpu=True)
        assert needle in str(caught.value) and "\n" not in str(caught.value), (needle, str(caught.value))
    for on_cpu in (True, False):  # GPUs run the ring's blocks as explicit fp32 tiles (attention_blocks.py)
        with pytest.raises(ConfigError) as caught:
            validate_run(config(context_parallel_comm="p2p"), 2, dataclasses.replace(SIX_HEADS, attention_dropout=0.1),
                         on_cpu=on_cpu)
        assert "'p2p' does not support attention_dropout > 0 yet" in str(caught.value)
        assert "\n" not in str(caught.value)
        assert validate_run(config(context_parallel_comm="p2p"), 2, SIX_HEADS, on_cpu=on_cpu).layout.ring
    # packed documents and sliding windows are masked in the ring's blocks (tests/distributed/test_finetune.py,
    # test_families.py): accepted
    validate_run(config(context_parallel_comm="p2p", data={"document_mask": True}), 2, SIX_HEADS, on_cpu=True)


def test_ring_lifts_the_head_limit_ulysses_has():
    with pytest.raises(LayoutError, match="not divisible by tensor_parallel_size \\* context_parallel_size"):
        check_split(SIX_HEADS, 2, cp=2)
    check_split(SIX_HEADS, 2, cp=2, ring=True)
    check_split(SIX_HEADS, 2, cp=4, ring=True)
    run = validate_run(config(context_parallel_comm="p2p", tensor_parallel_size=2), 4, SIX_HEADS)
    assert run.layout.ring and run.layout.cp == 2


def test_chunks_balance_the_causal_work():
    """Rank r holds chunks r and 2c-1-r of 2c: together the ranks hold every position once, and each has the same
    number of (query, key) pairs at or before the query (the causal work)."""
    s, c = 32, 4
    held = [chunk_positions(r, c, s) for r in range(c)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(s))
    work = {int((p + 1).sum()) for p in held}  # keys at or before each query position p: p + 1
    assert len(work) == 1
    assert chunk_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert ContextParallelGroup(group=object(), rank=0, size=2, ring=True).ring


def test_ulysses_inside_a_ring_holds_parts_of_the_ring_members_chunks():
    """a2a+p2p at c = 4, a2a 2 on 16 positions: a ring of 2 members, each holding chunks j and 3-j of 4; each of its
    two Ulysses ranks holds one half of each chunk, and Ulysses' all-to-all gathers them in rank order."""
    assert [rank_positions(r, 4, 2, 16).tolist() for r in range(4)] == [
        [0, 1, 12, 13], [2, 3, 14, 15], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert member_positions(0, 4, 2, 16).tolist() == [0, 1, 12, 13, 2, 3, 14, 15]
    assert torch.equal(member_positions(1, 4, 1, 16), chunk_positions(1, 4, 16))
    run = validate_run(config(context_parallel_comm="a2a+p2p", context_parallel_size=4, context_parallel_a2a_size=2),
                       4, SIX_HEADS)
    assert (run.layout.ring, run.layout.cp_a2a) == (True, 2)


def test_the_layout_line_names_the_ring_and_its_block_kernel():
    from hybrid3d.training.job import sequence_split

    layout = validate_run(config(context_parallel_comm="p2p", tensor_parallel_size=2), 4, SIX_HEADS).layout
    assert sequence_split(layout, 64, "cpu") == (" (32 tokens per rank: context_parallel_size 2 (p2p, ring blocks: "
                                                 "torch's fused CPU flash kernel))")
    assert "ring blocks: torch's memory-efficient kernel, checked at first use" in sequence_split(layout, 64, "cuda")
    assert "ring blocks: explicit fp32 tiles)" in sequence_split(layout, 64, "xpu")

"""The planner's ring attention (context_parallel_comm "p2p" and "a2a+p2p") in `--longest-sequence`: which layouts it
enumerates, the kv heads a ring rank keeps, the ring's step-time term, the table and its note. Expected values are
worked out by hand here, from the shapes, not read back from the planner."""

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.activations import activation_bytes_per_layer
from hybrid3d.planning.plan_cli import main
from hybrid3d.planning.planner import (
    Cluster,
    estimate_step_time,
    layout_refusal,
    longest_sequence,
    sequence_unit,
)

MAX_SEQ = 1 << 20


@pytest.fixture(scope="module")
def llama3_8b():
    return LlamaShape.from_hf(preset_config("llama3-8b"))  # 32 heads, 8 kv heads, d_h 128, h 4096, f 14336, L 32


@pytest.fixture(scope="module")
def on_64(llama3_8b):
    """Longest sequences of Llama 3 8B on 64 x 80 GB (8 per node), up to 1M tokens, with and without rings."""
    cluster = Cluster(gpus=64, gpu_memory_gb=80)
    rows, _ = longest_sequence(llama3_8b, cluster, 512, max_seq=MAX_SEQ)
    ulysses, _ = longest_sequence(llama3_8b, cluster, 512, max_seq=MAX_SEQ, rings=False)
    return cluster, rows, ulysses


def test_rings_reach_further_than_ulysses(llama3_8b, on_64):
    """Ulysses splits a sequence over at most t·c = 8 ranks (a node; 32 heads over t·c); a ring over any c."""
    cluster, rows, ulysses = on_64
    ring = [(c, s) for c, s in rows if c.ring]
    assert max(s for _, s in ring) > max(s for c, s in rows if not c.ring)
    # a ring where Ulysses refuses c: TP8 x CP8 (32 heads are not divisible by 64, and 64 ranks span 8 nodes)
    assert layout_refusal(llama3_8b, 8, 1, cluster, cp=8) is not None
    assert any((c.tp, c.cp, c.comm) == (8, 8, "p2p") for c, _ in ring)
    assert any(layout_refusal(llama3_8b, c.tp, c.pp, cluster, c.cp) is not None for c, _ in ring)
    # the Ulysses rows are those of a plan without rings, in the same order, to the last bit
    assert [(c, s) for c, s in rows if c.comm == "a2a"] == ulysses
    for c, seq in ring:  # 2c chunks: s a multiple of 2c (2c·t with SP)
        assert seq % (2 * c.cp * (c.tp if c.sp else 1)) == 0 and seq % 128 == 0 and c.memory_gb <= 80
        assert seq % sequence_unit(c.tp, c.cp, c.sp, ring=True) == 0


def test_hybrid_takes_the_largest_ulysses_group_a_node_allows(on_64):
    """a2a+p2p: u the largest divisor of c below c with 32 % (t·u) == 0, the 8/t kv heads and u dividing one
    another, and t·u dividing the 8 GPUs of a node."""
    _, rows, _ = on_64
    sizes = {(c.tp, c.cp): c.cp_a2a for c, _ in rows if c.comm == "a2a+p2p"}
    assert sizes[(1, 4)] == 2 and sizes[(1, 16)] == 8 and sizes[(1, 64)] == 8
    assert sizes[(2, 8)] == 4 and sizes[(4, 4)] == 2 and sizes[(4, 16)] == 2
    assert not any(tp == 8 for tp, _ in sizes)  # t·u >= 16 would cross nodes
    assert (1, 2) not in sizes  # no u strictly between 1 and 2


def test_six_heads_get_rings_but_no_ulysses_at_tp2():
    """6 heads / 2 kv heads at TP2 on 8 GPUs: 3 heads per TP rank, so Ulysses splits them over no c in {2, 4}
    (6 % (2·c)); the ring needs no head split, and a2a+p2p at c = 4 would need u = 2 (6 % 4 again)."""
    shape = LlamaShape(vocab_size=1024, hidden_size=384, intermediate_size=1024, num_layers=4, num_heads=6,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=8192)
    rows, refused = longest_sequence(shape, Cluster(gpus=8, gpu_memory_gb=80), 8)
    tp2 = [c for c, _ in rows if c.tp == 2]
    assert {c.cp for c in tp2 if c.comm == "p2p"} == {2, 4}
    assert not any(c.cp > 1 and c.comm != "p2p" for c in tp2)
    assert any(r.startswith("TP2 PP1 CP2 DP2: num_attention_heads (6)") for r in refused)


def test_ring_step_time_by_hand(llama3_8b):
    """t 1, c 2, b 1, s 4096, m 1, one node: each rank holds 2048 positions of the 8 kv heads; a K/V block is
    2·2048·8·128 elements. Forward: 1 hop of bf16 K/V; backward: 1 hop of K/V with fp32 dK/dV (2 + 4 bytes) and
    the gradients home (4 bytes). 32 layers at the 200 GB/s intra-node link."""
    cluster = Cluster(gpus=8, gpu_memory_gb=80)
    block = 2 * 2048 * 8 * 128
    forward, backward = block * 2, block * 6 + block * 4
    step = estimate_step_time(llama3_8b, cluster, 1, 1, 4, 1, 1, 1, 4096, cp=2, comm="p2p")
    assert step.cp == pytest.approx((forward + backward) * 32 / 200e9)
    ckpt = estimate_step_time(llama3_8b, cluster, 1, 1, 4, 1, 1, 1, 4096, checkpointing=True, cp=2, comm="p2p")
    assert ckpt.cp == pytest.approx((2 * forward + backward) * 32 / 200e9)  # the forward recomputed
    # c = 16 on 8 GPUs per node: the ring crosses nodes (25 GB/s); 256 positions a rank, 15 hops
    block16 = 2 * 256 * 8 * 128
    wide = estimate_step_time(llama3_8b, Cluster(gpus=16, gpu_memory_gb=80), 1, 1, 1, 1, 1, 1, 4096, cp=16,
                              comm="p2p")
    assert wide.cp == pytest.approx((15 * block16 * 2 + 15 * block16 * 6 + block16 * 4) * 32 / 25e9)


def test_hybrid_step_time_by_hand(llama3_8b):
    """a2a+p2p, t 1, c 4, u 2, s 4096: Ulysses over 2 ranks of 1024 positions (q and output 1024·32·128, k and v
    1024·8·128 elements; 4 all-to-alls forward and 4 backward, (u-1)/u of them leave the rank), then a ring of 2
    members of 2048 positions and 4 kv heads each (block 2·2048·4·128), all inside one node."""
    q, kv = 1024 * 32 * 128, 1024 * 8 * 128
    all_to_all = 2 * (2 * q + 2 * kv) * 2 * 32 / 2
    block = 2 * 2048 * 4 * 128
    ring = (block * 2 + block * 6 + block * 4) * 32
    step = estimate_step_time(llama3_8b, Cluster(gpus=8, gpu_memory_gb=80), 1, 1, 2, 1, 1, 1, 4096, cp=4,
                              comm="a2a+p2p", cp_a2a=2)
    assert step.cp == pytest.approx((all_to_all + ring) / 200e9)


def test_ring_keeps_kv_heads_unrepeated(llama3_8b):
    """Llama 3 8B at t 8 has 1 kv head per TP rank. Per layer, b 1, s 8192, c 4 (s_c 2048), bf16: norms
    16·2048·4096 + 8·2048, q 2·2048·32·128/8, output twice q, SwiGLU 8·2048·14336/8, fp32 log-sum-exp
    4·32·8192/(8·4); K and V 2·2·2048·k·128 with k = 1 for the ring (sent as it is), 4 for Ulysses over c = 4
    (repeated so each rank gets one), 2 for Ulysses over u = 2 inside a2a+p2p. RoPE: Ulysses' blocks multiply by
    the rank's shared (s, d_h) tables (counted once per rank, not here); a ring's blocks gather their rows at
    their u·s/c positions, 2·2·(u·2048)·128, and save the int64 table of the ring's positions, 8·8192."""
    rest = (16 * 2048 * 4096 + 8 * 2048) + 2 * 2048 * 32 * 128 // 8 * 3 + 8 * 2048 * 14336 // 8 \
        + 4 * 32 * 8192 // 32
    kv = 2 * 2 * 2048 * 128  # per kv head
    rope_rows = 2 * 2 * 2048 * 128  # per Ulysses rank of a ring member
    table = 8 * 8192
    assert activation_bytes_per_layer(llama3_8b, 1, 8192, 8, cp=4, comm="p2p") == rest + kv + rope_rows + table \
        == 172_081_152
    assert activation_bytes_per_layer(llama3_8b, 1, 8192, 8, cp=4) == rest + 4 * kv
    assert activation_bytes_per_layer(llama3_8b, 1, 8192, 8, cp=4, comm="a2a+p2p", cp_a2a=2) \
        == rest + 2 * kv + 2 * rope_rows + table
    # with a mask Ulysses' core repeats K and V to the query heads; the ring's blocks do not keep them repeated
    assert activation_bytes_per_layer(llama3_8b, 1, 8192, 8, cp=4, mask="window", comm="p2p") \
        == rest + kv + rope_rows + table


def test_cli_prints_ring_rows_and_the_note(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "16", "--gpu-memory", "80", "--global-batch", "16",
            "--longest-sequence", "--max-seq-length", str(MAX_SEQ), "--top", "10"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["seq", "tp"])
    table = [dict(zip(header, line.split())) for line in lines
             if len(line.split()) == len(header) and line.split()[0].isdigit()]
    assert len(table) == 10 and header[:5] == ["seq", "tp", "pp", "cp", "comm"]
    assert any(row["comm"] == "p2p" for row in table) and any(row["comm"].endswith("+p2p") for row in table)
    notes = [line for line in lines if "ring attention" in line and "masked blocks" in line]
    assert len(notes) == 1 and "assume a fused kernel" in notes[0]

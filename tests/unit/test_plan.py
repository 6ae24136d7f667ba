"""The layout planner: feasible layouts for Llama 3 8B on 8 x 80 GB, refusals with reasons, CLI errors;
sequence and context parallelism, the longest-sequence search (its ring attention: test_ring_planning.py)."""

import subprocess
import sys

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET
from hybrid3d.planning.plan_cli import main
from hybrid3d.planning.planner import (
    Cluster,
    estimate_step_time,
    evaluate,
    layout_refusal,
    longest_sequence,
    plan,
    sequence_unit,
)
from hybrid3d.planning.zero3_fetch import Zero3Knobs
from hybrid3d.planning.zero3_memory import live_parameter_bytes

PSI_8B = 8_030_261_248  # Llama 3 8B parameters


@pytest.fixture(scope="module")
def llama3_8b():
    return LlamaShape.from_hf(preset_config("llama3-8b"))


def test_llama3_8b_on_8x80(llama3_8b):
    feasible, refused = plan(llama3_8b, Cluster(gpus=8, gpu_memory_gb=80), seq=4096, global_batch=512)
    assert feasible and all(c.memory_gb <= 80 for c in feasible)
    assert all(c.tp * c.pp * c.dp == 8 for c in feasible)
    assert any(c.tp > 1 for c in feasible) and any(c.pp > 1 for c in feasible)
    assert [c.step_seconds for c in feasible] == sorted(c.step_seconds for c in feasible)
    # Plain DP keeps 20 bytes per parameter (bf16 params and grads, fp32 master and grads, Adam): 160.6 GB.
    zero0 = next(r for r in refused if r.startswith("TP1 PP1 DP8 ZeRO-0"))
    assert f"{20 * PSI_8B / 1e9:.1f} model states" in zero0
    # ZeRO-1 (BF16_Optimizer): 2 + 2 + 4 bytes replicated + 12/8 sharded = 9.5 bytes per parameter; it fits only
    # with the optimizer offloaded
    zero1 = evaluate(llama3_8b, Cluster(gpus=8, gpu_memory_gb=80), 1, 1, 1, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET)
    assert round(zero1.states_gb, 1) == round(9.5 * PSI_8B / 1e9, 1)
    assert zero1.memory_gb > 80
    assert not any(c.tp == 1 and c.pp == 1 and c.zero in (0, 1) and c.offload == "none" for c in feasible)


def test_zero3_and_offload_rows(llama3_8b):
    """ZeRO-3 and offload rows (planning/offload_plan.py): Llama 3 8B fits one 80 GB GPU only with its optimizer in
    host memory; ZeRO-3 at DP1 with the optimizer offloaded keeps 2 bytes per parameter and the gathered layers on
    the device, 18 on the host (bf16 gradient partition, fp32 gradient, master, Adam's moments); a host limit
    removes what does not fit it; ZeRO-3 only without a pipeline; the offloaded step is slower."""
    one = Cluster(gpus=1, gpu_memory_gb=80)
    feasible, refused = plan(llama3_8b, one, seq=4096, global_batch=8)
    assert feasible and all(c.offload != "none" and c.memory_gb <= 80 for c in feasible)
    assert {c.zero for c in feasible} >= {1, 3}
    zero3 = next(c for c in feasible if c.zero == 3 and c.offload == "optimizer")
    assert zero3.host_gb == pytest.approx(18 * PSI_8B / 1e9)
    # the parameters gathered at once: DeepSpeed's coordinator replayed (planning/zero3_fetch.py, checked against
    # DeepSpeed in tests/distributed/test_zero3_memory.py); with the default 1e9-element live cap its prefetcher runs
    # ahead of the forward by up to 1e9 elements, more than the embedding and head layers of 5.3e8 the module runs
    live = live_parameter_bytes(llama3_8b, 1, "bf16")
    assert 2 * 1e9 < live < 2 * 1.6e9
    norms = (2 * 32 + 1) * 4096  # persistent (below 1e5 elements): whole between the steps
    assert zero3.states_gb == pytest.approx((2 * PSI_8B + 2 * DEFAULT_REDUCE_BUCKET + live + 2 * norms) / 1e9)
    # a lower cap (DeepSpeed's stage3_max_live_parameters) holds about the module running and one prefetch
    capped = live_parameter_bytes(llama3_8b, 1, "bf16", Zero3Knobs(max_live=10**8))
    assert 2 * 128_256 * 4096 < capped < 2 * (128_256 * 4096 + 5e7 + 2.2e8)
    assert plan(llama3_8b, Cluster(gpus=1, gpu_memory_gb=80, host_memory_gb=100), 4096, 8)[0] == []
    eight = Cluster(gpus=8, gpu_memory_gb=80)
    rows, _ = plan(llama3_8b, eight, seq=4096, global_batch=512, sequence_parallel=True, schedules=True)
    assert any(c.zero == 3 for c in rows) and all(c.pp == 1 for c in rows if c.zero == 3)
    on_device = evaluate(llama3_8b, eight, 2, 1, 1, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET)
    on_host = evaluate(llama3_8b, eight, 2, 1, 1, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET, offload="optimizer")
    assert on_host.step_seconds > on_device.step_seconds and on_host.states_gb < on_device.states_gb


def test_asynchronous_saves_count_their_host_copy(llama3_8b):
    """checkpoint.async (planning/checkpoint_copy.py): Llama 3 8B at TP2 x DP4, ZeRO-1, bf16: data-parallel rank 0
    copies its TP half of the bf16 weights and its quarter of the fp32 master and Adam's moments, 2/2 + 12/8 bytes a
    parameter; ZeRO-3 over 8 ranks copies 14/8; the planner counts it in host GB and drops rows a host cannot hold."""
    eight = Cluster(gpus=8, gpu_memory_gb=80)
    sync = evaluate(llama3_8b, eight, 2, 1, 1, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET)
    copy = evaluate(llama3_8b, eight, 2, 1, 1, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET, async_checkpoint=True)
    assert copy.memory_gb == sync.memory_gb and copy.host_gb - sync.host_gb == pytest.approx((1 + 1.5) * PSI_8B / 1e9,
                                                                                             rel=2e-3)
    zero3 = evaluate(llama3_8b, eight, 1, 1, 3, True, 1, 4096, 512, DEFAULT_REDUCE_BUCKET, async_checkpoint=True)
    assert zero3.host_gb == pytest.approx(14 / 8 * PSI_8B / 1e9, rel=1e-3)
    small_host = Cluster(gpus=8, gpu_memory_gb=80, host_memory_gb=8 * 16)  # 16 GB a GPU: 14/8 bytes a parameter fit
    rows, kept = plan(llama3_8b, small_host, 4096, 512)[0], plan(llama3_8b, small_host, 4096, 512,
                                                                  async_checkpoint=True)[0]
    assert 0 < len(kept) < len(rows) and all(c.host_gb <= 16 for c in kept)


def test_refusals_name_the_reason(llama3_8b):
    feasible, refused = plan(llama3_8b, Cluster(gpus=16, gpu_memory_gb=80), seq=4096, global_batch=512)
    assert any("tp=16 > 8 GPUs per node" in r for r in refused)
    assert not any(c.tp > 8 for c in feasible)
    assert any("num_key_value_heads" in r or "num_attention_heads" in r
               for r in plan(llama3_8b, Cluster(gpus=64, gpu_memory_gb=80, gpus_per_node=64), 4096, 512)[1])
    # offloaded to a 64 GB host, 8B still needs more than 2 x 16 GB (ZeRO-3 with both offloads: 80 GB of host per GPU)
    nothing, refused_small = plan(llama3_8b, Cluster(gpus=2, gpu_memory_gb=16, host_memory_gb=64), seq=4096,
                                  global_batch=64)
    assert nothing == [] and refused_small


def test_cli_prints_a_table(capsys):
    assert main(["--model", "llama3.2-1b", "--gpus", "8", "--gpu-memory", "24", "--seq-length", "2048"]) == 0
    out = capsys.readouterr().out
    assert "rel.time" in out and "refused:" in out
    assert "pp comm" in out and "pipeline traffic" in out


@pytest.mark.parametrize("argv", [
    ["--model", "llama9", "--gpus", "8", "--gpu-memory", "80"],
    ["--model", "llama3-8b", "--gpus", "0", "--gpu-memory", "80"],
    ["--model", "llama3-8b", "--gpus", "8"],
    ["--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-length", "100000"],
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def run_planner(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid3d.plan", *argv], capture_output=True, text=True, timeout=300)


# What DeepSpeed's logger prints (`[WARNING] [real_accelerator.py:...] Setting accelerator to CPU ...` on import,
# `ds_accelerator` lines when it detects one)
DEEPSPEED_LOG_MARKS = ("[WARNING]", "[INFO]", "real_accelerator", "ds_accelerator")


def deepspeed_log_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines()
            if any(mark in line for mark in DEEPSPEED_LOG_MARKS)]


def test_cli_process_exit_code(tmp_path):
    result = run_planner("--model", str(tmp_path), "--gpus", "8", "--gpu-memory", "80")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "\n" not in result.stderr.strip() and "Traceback" not in result.stderr
    assert deepspeed_log_lines(result) == []


def test_cli_answer_comes_first_without_deepspeed_log():
    """The planner imports DeepSpeed (its solver, schedules, topology) but needs no accelerator: DeepSpeed's
    detection line is held back (hybrid3d/plan.py), so the answer, or the usage, is the first line."""
    answer = run_planner("--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith("llama3-8b: 8 x 80 GB") and answer.stderr == ""
    usage = run_planner("--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m hybrid3d.plan") and usage.stderr == ""
    assert deepspeed_log_lines(answer) == deepspeed_log_lines(usage) == []


def test_context_parallelism_refusals(llama3_8b):
    one_node = Cluster(gpus=64, gpu_memory_gb=80, gpus_per_node=64)
    assert layout_refusal(llama3_8b, 1, 2, one_node, cp=2) is None  # CP with a pipeline
    heads = layout_refusal(llama3_8b, 8, 1, one_node, cp=8)
    assert "num_attention_heads (32) is not divisible by tensor_parallel_size * context_parallel_size" in heads
    assert "tp·cp = 16 > 8 GPUs per node" in layout_refusal(llama3_8b, 2, 1, Cluster(gpus=64, gpu_memory_gb=80), cp=8)
    assert layout_refusal(llama3_8b, 2, 1, one_node, cp=8) is None  # 4 kv heads per TP rank, 2 per CP rank
    gqa = LlamaShape(vocab_size=1024, hidden_size=768, intermediate_size=1024, num_layers=2, num_heads=12,
                     num_kv_heads=4, head_dim=64)
    kv = layout_refusal(gqa, 1, 1, Cluster(gpus=6, gpu_memory_gb=80, gpus_per_node=6), cp=6)
    assert "kv heads of a tensor-parallel rank" in kv and "context_parallel_size (6) must divide" in kv
    feasible, refused = plan(llama3_8b, Cluster(gpus=16, gpu_memory_gb=80), 4096, 512, context_parallel=True)
    assert any(c.cp > 1 and c.pp > 1 for c in feasible) and any(c.cp > 1 and c.pp == 1 for c in feasible)
    assert all(c.tp * c.pp * c.cp * c.dp == 16 for c in feasible)
    assert all(c.tp * c.cp <= 8 for c in feasible)
    assert any(r.startswith("CP > 1: only with tp·cp <= 8 GPUs per node") for r in refused)


def test_tp_groups_must_tile_the_nodes(llama3_8b):
    """Ranks fill nodes in order (parallel/placement.py): with 6 GPUs per node a TP4 group would straddle two."""
    six = Cluster(gpus=12, gpu_memory_gb=80, gpus_per_node=6)
    assert "tp·cp = 4 does not divide 6 GPUs per node" in layout_refusal(llama3_8b, 4, 1, six)
    assert layout_refusal(llama3_8b, 2, 1, six) is None
    feasible, _ = plan(llama3_8b, six, 4096, 96)
    assert feasible and all(6 % (c.tp * c.cp) == 0 for c in feasible)


def test_planner_with_sp_and_cp(llama3_8b):
    """On 8 x 80 GB, TP1 PP1 DP8 ZeRO-1 does not fit (9.5 bytes per parameter + activations of 4096 tokens);
    with c = 8 ZeRO still shards over d·c = 8 ranks (the same 76.3 GB of model states) while each rank
    keeps 1/8 of the activations, so it fits."""
    cluster = Cluster(gpus=8, gpu_memory_gb=80)
    feasible, _ = plan(llama3_8b, cluster, 4096, 512, sequence_parallel=True, context_parallel=True)
    cp8 = next(c for c in feasible if (c.tp, c.pp, c.cp, c.dp, c.zero, c.offload) == (1, 1, 8, 1, 1, "none"))
    assert cp8.states_gb == pytest.approx(9.5 * PSI_8B / 1e9, rel=1e-3)
    for c in feasible:
        step = estimate_step_time(llama3_8b, cluster, c.tp, c.pp, c.dp, c.zero, c.micro_batch, c.gas, 4096,
                                  c.precision, c.checkpointing, sequence_parallel=c.sp, cp=c.cp, offload=c.offload)
        assert c.step_seconds == step.seconds and c.dp * c.micro_batch * c.gas == 512
    # Ulysses time by hand (t 1, c 2, b 1, s 4096, m 1): per block q and output 2048·32·128 elements, k and v
    # 2048·8·128; 4 all-to-alls x 2 bytes forward, the same backward, 32 blocks; (c-1)/c of it at 200 GB/s.
    block = (2 * 2048 * 32 * 128 + 2 * 2048 * 8 * 128) * 2
    step = estimate_step_time(llama3_8b, cluster, 1, 1, 4, 1, 1, 1, 4096, cp=2)
    assert step.cp == pytest.approx(2 * 32 * block / 2 / 200e9)
    plain = estimate_step_time(llama3_8b, cluster, 1, 1, 4, 1, 1, 1, 4096)
    assert step.compute == pytest.approx(plain.compute / 2) and plain.cp == 0


def test_longest_sequence_search(llama3_8b):
    cluster = Cluster(gpus=8, gpu_memory_gb=80)
    rows, refused = longest_sequence(llama3_8b, cluster, 64, max_seq=65536)
    assert rows and [(-s, c.step_seconds) for c, s in rows] == sorted((-s, c.step_seconds) for c, s in rows)
    for c, seq in rows[:5]:
        unit = sequence_unit(c.tp, c.cp, c.sp, c.ring)
        assert seq % unit == 0 and seq <= 65536 and c.micro_batch == 1 and c.memory_gb <= 80
        if seq + unit <= 65536:  # one step longer does not fit
            longer = evaluate(llama3_8b, cluster, c.tp, c.pp, c.zero, c.checkpointing, 1, seq + unit, 64,
                              DEFAULT_REDUCE_BUCKET, c.sp, c.cp, c.schedule, c.virtual, c.comm, c.cp_a2a)
            assert longer.memory_gb > 80
    assert sequence_unit(2, 4, True) == 128 and sequence_unit(3, 1, True) == 384 and sequence_unit(3, 1, False) == 128
    assert sequence_unit(1, 128, False, ring=True) == 256 and sequence_unit(3, 2, True, ring=True) == 384


def test_longest_sequence_cli(capsys):
    argv = ["--model", "llama3.2-1b", "--gpus", "8", "--gpu-memory", "24", "--longest-sequence",
            "--max-seq-length", "32768", "--top", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "longest sequence up to 32768 tokens" in out and "rel.t/tok" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["seq", "tp"])
    assert header.split()[:8] == ["seq", "tp", "pp", "cp", "comm", "dp", "sp", "zero"]


@pytest.mark.parametrize("argv", [
    ["--max-seq-length", "65536"],
    ["--longest-sequence", "--seq-length", "4096"],
    ["--longest-sequence", "--max-seq-length", "0"],
    ["--longest-sequence", "--max-seq-length", "many"],
])
def test_longest_sequence_bad_flags_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama3.2-1b", "--gpus", "8", "--gpu-memory", "24", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_gpu_memory_accepts_units_and_says_what_it_wants():
    import argparse

    from hybrid3d.planning.hints import gb, parse_gigabytes

    assert parse_gigabytes("80") == parse_gigabytes("80GB") == parse_gigabytes("80 gb") == parse_gigabytes("80G") == 80
    assert parse_gigabytes("80GiB") == pytest.approx(85.899, abs=1e-3)
    with pytest.raises(argparse.ArgumentTypeError, match=r"a positive number of GB \(80, 80GB or 80GiB\), got '80XB'"):
        parse_gigabytes("80XB")
    assert (gb(1.034), gb(13.66), gb(112.0)) == ("1.03", "13.7", "112.0")  # never "1.0 GB > 1 GB"


def test_no_layout_fits_says_what_would(capsys):
    # with no more than 16 GB of host memory: offloading the optimizer (9 GB per GPU at ZeRO-1) is not enough either
    assert main(["--model", "llama3.2-1b", "--gpus", "1", "--gpu-memory", "24GB", "--host-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "no layout fits" in out and "the least memory any option needs" in out
    assert "try --gpus 2" in out and "offload" in out and "micro-batch 1 are already" in out
    assert "ZeRO-0 rows accumulate gradients in bf16" in out  # why a ZeRO-1 row can need more than ZeRO-0


def test_lora_rank_makes_llama3_8b_fit_one_gpu(capsys, llama3_8b):
    """Full fine-tuning of Llama 3 8B needs >= 16 bytes per parameter: no layout fits one 80 GB GPU without the
    optimizer in host memory (here a 128 GB host, less than its 144 GB of offloaded states). With LoRA rank 16
    on all 7 projections the 8.03B base is frozen in bf16 (16.06 GB) and only the 41.94M adapters carry gradients,
    fp32 masters and Adam states (20 bytes each with ZeRO-0/1 on one GPU: 0.84 GB), so it fits."""
    argv = ["--model", "llama3-8b", "--gpus", "1", "--gpu-memory", "80", "--host-memory", "128"]
    assert main(argv) == 0
    assert "no layout fits" in capsys.readouterr().out
    assert main(argv + ["--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("global batch 512 sequences, LoRA rank 16")
    assert "41.94M adapter parameters trained; the 8.03B base frozen" in out and "no layout fits" not in out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["tp", "pp"])
    rows = [dict(zip(header, line.split())) for line in out.splitlines()
            if line.split()[:4] == ["1", "1", "1", "1"]]
    assert rows and all(float(row["GB/GPU"]) <= 80 for row in rows)
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    zero1 = next(row for row in rows if row["zero"] == "1")
    assert float(zero1["states"]) == pytest.approx((2 * PSI_8B + 20 * adapters + 4) / 1e9, abs=0.05)  # 16.9
    # pipeline_zero2 (ZeRO-2 with p > 1) is not offered with LoRA, as the trainer refuses it
    from hybrid3d.planning.planner import with_lora

    feasible, _ = plan(with_lora(llama3_8b, 16), Cluster(gpus=4, gpu_memory_gb=80), 4096, 64)
    assert any(c.pp > 1 for c in feasible) and not any(c.pp > 1 and c.zero == 2 for c in feasible)


def test_lora_with_zero3_partitions_the_frozen_base():
    """LoRA rows at ZeRO-3 (offload_plan.worst_rank_placed): the frozen bf16 base is partitioned over the DP ranks
    like every weight (2 bytes a parameter / 8 at DP8, where ZeRO-1 keeps all 2 on each GPU), the adapters carry
    ZeRO-3's states; Llama 3 70B with rank-16 adapters on 8 x 80 GB."""
    from hybrid3d.planning.planner import with_lora

    shape = with_lora(LlamaShape.from_hf(preset_config("llama3-70b")), 16)
    eight = Cluster(gpus=8, gpu_memory_gb=80)
    rows, _ = plan(shape, eight, 4096, 64)
    zero3 = [c for c in rows if c.zero == 3]
    assert zero3 and all(c.offload == "none" for c in zero3)
    base = 70_553_706_496  # Llama 3 70B's parameters
    z3 = evaluate(shape, eight, 1, 1, 3, True, 1, 4096, 64, DEFAULT_REDUCE_BUCKET)
    z1 = evaluate(shape, eight, 1, 1, 1, True, 1, 4096, 64, DEFAULT_REDUCE_BUCKET)
    assert z1.states_gb > 2 * base / 1e9
    # beside the base's partitions: the gathered parameters, the reduce bucket (bf16) and the adapters' ZeRO-3
    # states, 22 bytes an adapter parameter / 8 (lp and fp32-accumulated gradient partitions, fp32 gradient,
    # master, Adam's moments)
    rest = (live_parameter_bytes(shape, 1, "bf16") + 2 * DEFAULT_REDUCE_BUCKET) / 1e9
    adapters = 22 * 207_093_760 / 8 / 1e9
    assert 2 * base / 8 / 1e9 + adapters < z3.states_gb - rest < 2 * base / 8 / 1e9 + adapters + 0.01


@pytest.mark.parametrize("argv", [
    ["--lora-rank", "-1"],
    ["--lora-targets", "q_proj,v_proj"],
    ["--lora-rank", "8", "--lora-targets", "q_proj,qkv"],
])
def test_lora_bad_flags_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "llama3.2-1b", "--gpus", "8", "--gpu-memory", "24", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_lora_targets_and_moe_refusal(llama3_8b):
    from hybrid3d.errors import ConfigError
    from hybrid3d.planning.planner import with_lora

    assert with_lora(llama3_8b, 0) is llama3_8b
    assert with_lora(llama3_8b, 8, ("v_proj", "q_proj")).lora_targets == ("q_proj", "v_proj")
    moe = LlamaShape(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, num_experts=4)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        with_lora(moe, 16)

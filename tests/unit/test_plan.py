"""The layout planner: feasible layouts for Llama 3 8B on 8 x 80 GB, refusals with reasons, CLI errors."""

import subprocess
import sys

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.planner import Cluster, main, plan

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
    # ZeRO-1 (BF16_Optimizer): 2 + 2 + 4 bytes replicated + 12/8 sharded = 9.5 bytes per parameter.
    zero1 = next(r for r in refused if r.startswith("TP1 PP1 DP8 ZeRO-1"))
    assert f"{9.5 * PSI_8B / 1e9:.1f} model states" in zero1
    assert not any(c.tp == 1 and c.pp == 1 and c.zero in (0, 1) for c in feasible)


def test_refusals_name_the_reason(llama3_8b):
    feasible, refused = plan(llama3_8b, Cluster(gpus=16, gpu_memory_gb=80), seq=4096, global_batch=512)
    assert any("tp=16 > 8 GPUs per node" in r for r in refused)
    assert not any(c.tp > 8 for c in feasible)
    assert any("num_key_value_heads" in r or "num_attention_heads" in r
               for r in plan(llama3_8b, Cluster(gpus=64, gpu_memory_gb=80, gpus_per_node=64), 4096, 512)[1])
    nothing, refused_small = plan(llama3_8b, Cluster(gpus=2, gpu_memory_gb=16), seq=4096, global_batch=64)
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


def test_cli_process_exit_code(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hybrid3d.plan", "--model", str(tmp_path), "--gpus", "8",
                             "--gpu-memory", "80"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr

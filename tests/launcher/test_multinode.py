"""Multi-node launching: one `deepspeed --hostfile H --no_ssh --node_rank r` process per "node" (here two on one
machine, as a scheduler starts one per node), both pointing at rank 0's rendezvous. The 4-rank TP2xPP2 demo job
spans the two nodes (TP inside each, the pipeline across them) and must train exactly like the single-host
run of the same layout and end when a node dies (its ranks killed -9, one of them while writing a checkpoint); the
job then resumes (in the pooled world) to the same losses and weights: nothing the killed save wrote is lost or
taken for complete."""

import json
import subprocess
import time
from pathlib import Path

import torch

from tests.launcher.harness import (STEPS, TRAIN, _port, config_copy, deepspeed_launcher,
                                    launcher_env_by_rank, layer_states, read_metrics)
from tests.launcher.in_world import run_job

HOSTFILE = "node0 slots=2\nnode1 slots=2\n"


def per_node_commands(config: Path, hostfile: Path, *overrides: str) -> list[list[str]]:
    """The command each node runs: the same rendezvous (rank 0's address and port) and its own --node_rank."""
    port = str(_port())
    return [[*deepspeed_launcher(), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
             "127.0.0.1", "--master_port", port, str(TRAIN), "--deepspeed_config", str(config), *overrides]
            for node in (0, 1)]


def test_per_node_launch_trains_like_one_host_survives_losing_a_node_and_resumes(uninterrupted, tmp_path):
    """Both nodes launch the job and it trains exactly like the single-host run; node 1 then dies (every process,
    SIGKILL) while the job saves its step-8 checkpoint: node 0's ranks end within the bound with an error naming
    the failure, `latest` still names the committed step-4 checkpoint, and the job resumes from it to the
    uninterrupted run's losses and weights. (One launch pair trains and loses a node; the resume runs in the pooled
    world of 4, reading the same files a second launch pair would.)"""
    import psutil

    from tests.launcher.harness import fault_env, wait_for

    # timeout_seconds: the hang watchdog, the backstop behind gloo's own errors
    config = config_copy(uninterrupted["config"], tmp_path / "config.json", tmp_path / "run", timeout_seconds=60)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    marker = tmp_path / "rank2-in-save"
    env = fault_env({"kind": "pause_in_save", "rank": 2, "match": "global_step8", "marker": str(marker)})
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
             for cmd in per_node_commands(config, hostfile)]
    assert wait_for(marker.exists, procs[0], timeout=400), procs[0].communicate(timeout=60)[0][-4000:]
    node1 = psutil.Process(procs[1].pid)
    for proc in node1.children(recursive=True) + [node1]:
        proc.kill()
    killed = time.time()
    output, _ = procs[0].communicate(timeout=300)
    ended = time.time() - killed
    procs[1].communicate(timeout=60)

    # what the launcher gave each rank, as the job recorded it
    places = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert [p["env"] for p in places] == launcher_env_by_rank(nodes=2, slots=2)
    assert [(p["stage"], p["tp"]) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # TP inside, PP across
    assert "node 1" in output and "warning" not in output.split("training steps")[0]
    # the same losses as the single-host run up to the save that node 1 died in, to the bit (fp32; the same ranks
    # do the same work)
    trained = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(trained) >= STEPS - 1 and trained == [m["loss"] for m in uninterrupted["metrics"]][:len(trained)]

    assert procs[0].returncode != 0 and ended < 120, (ended, output[-4000:])
    assert "error: rank 0: lost contact with another rank in the checkpoint save at step 8" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step4"
    # the save killed half-way stays staged, never under its tag
    assert not (checkpoints / "global_step8").exists() and (checkpoints / "global_step8.incomplete").exists()

    # the job resumes from the step-4 checkpoint: steps 5-8 again, exactly, to the same weights. In the pooled
    # world of 4: the per-node launch is the first pair's subject, and a resume reads the same files either way.
    resumed = run_job(4, config, "--checkpoint.load", "latest")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "at step 4" in resumed.stdout, resumed.stdout[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["loss"] for m in metrics[-4:]] == [m["loss"] for m in uninterrupted["metrics"][4:]]
    final = layer_states(checkpoints / "global_step8")
    expected = layer_states(uninterrupted["out"] / "checkpoints" / "global_step8")
    assert final.keys() == expected.keys() and len(final) == 14
    assert all(torch.equal(final[f][k], expected[f][k]) for f in final for k in final[f])
    assert not (checkpoints / "global_step8.incomplete").exists()  # the resumed save replaced it
    print(f"node 0 ended {ended:.1f} s after node 1 was killed:", *[l for l in output.splitlines() if "error" in l.lower()][:6], sep="\n")

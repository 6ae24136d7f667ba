"""What a new user does first, end to end (issue 22): Ctrl-C in the terminal, a plain `python launch/train.py`
(no launcher), a second run into the same folder, and the README's Hugging Face commands as written.

One launcher run is stopped by a Ctrl-C; its checkpoint then serves the single-process checks."""

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.launcher.harness import REPO, TRAIN, deepspeed_command, deepspeed_launcher, demo_config, launch_env
from tests.launcher.in_world import run_job


def python_env() -> dict:
    """A plain process's environment: this checkout importable, no launcher variables."""
    env = {k: v for k, v in launch_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def ctrl_c(tmp_path_factory):
    """The demo (4 ranks, TP2 x PP2) stopped by a Ctrl-C after step 2: SIGINT to the launcher's whole process
    group, as a terminal sends it."""
    tmp = tmp_path_factory.mktemp("ctrl_c")
    config = demo_config(tmp)
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["train"].update(steps=200, eval_interval=0)
    raw["hybrid3d"]["checkpoint"]["save_interval"] = 0
    config.write_text(json.dumps(raw))
    proc = subprocess.Popen(deepspeed_command(4, config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp, env=launch_env(), start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # until every rank closed it
    reader.start()
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
             if "launch/train.py --local_rank" in " ".join(p.cmdline())]  # docs/reliability.md's pkill pattern
    os.killpg(proc.pid, signal.SIGINT)
    runner_rc = proc.wait(timeout=120)
    reader.join(timeout=300)
    return dict(tmp=tmp, config=config, runner_rc=runner_rc, ranks=len(ranks),
                lines=[line.rstrip("\n") for line in lines], out=tmp / "run")


DEEPSPEED_LOG = re.compile(r"\[[^\]]+\] \[[A-Z]+\] \[(launch|runner)\.py:\d+:\w+\] ")  # DeepSpeed's logger
FRAME = re.compile(r'  File "(.+)", line \d+, in \S+')


def not_from_the_launcher(lines: list[str]) -> list[str]:
    """The lines of `lines` (what a run stopped by Ctrl-C printed after its `stopped by` line) that DeepSpeed's
    launcher did not print. It may print them in either order with the ranks' last words (a race): launch.py's and
    runner.py's log lines (launch.py waiting for each rank to exit), and the runner's KeyboardInterrupt traceback
    (no SIGINT handler on one node: runner.py's `result.wait()`): its header, frames in the `deepspeed` script,
    deepspeed/launcher/ or the stdlib's subprocess module with their source (and caret) lines, the final
    `KeyboardInterrupt`. Anything else is returned: a step line, a second `stopped by` line, an `error:` line, a
    frame elsewhere (hybrid3d, launch/train.py) and the source lines under it."""
    package = importlib.util.find_spec("deepspeed").submodule_search_locations[0]  # found, not imported
    launcher_dir = str(Path(package) / "launcher") + os.sep
    launcher_files = {subprocess.__file__, str(Path(sys.executable).with_name("deepspeed"))}
    foreign, in_launcher_frame = [], False
    for line in lines:
        frame = FRAME.fullmatch(line)
        if frame:
            in_launcher_frame = frame.group(1).startswith(launcher_dir) or frame.group(1) in launcher_files
            ours = in_launcher_frame
        elif line.startswith("    "):  # the source line under a frame, or the carets under that
            ours = in_launcher_frame
        elif DEEPSPEED_LOG.match(line):  # another process of the launcher: leaves a traceback's frame open
            ours = True
        else:
            in_launcher_frame = False
            ours = line in ("Traceback (most recent call last):", "KeyboardInterrupt")
        if not ours:
            foreign.append(line)
    return foreign


def test_ctrl_c_ends_with_one_line_after_the_commit(ctrl_c):
    lines = [line for line in ctrl_c["lines"] if line.strip()]
    assert ctrl_c["ranks"] == 4
    # DeepSpeed's runner has no SIGINT handler on one node: KeyboardInterrupt, 130 (docs/reliability.md)
    assert ctrl_c["runner_rc"] in (-signal.SIGINT, 130, 1), ctrl_c["runner_rc"]
    final = [i for i, line in enumerate(lines) if line.startswith("stopped by")]
    assert len(final) == 1, "\n".join(lines[-15:])
    last = re.fullmatch(r"stopped by Ctrl-C \(SIGINT\) after step (\d+); checkpoint (\S+) committed \(resume with "
                        r"--checkpoint.load latest\)", lines[final[0]])
    assert last, lines[final[0]]
    # after it, only DeepSpeed's launcher: launch.py's log of waiting for each rank to exit (`deepspeed --quiet`
    # drops it) and, whichever comes first, the runner's KeyboardInterrupt traceback
    assert not not_from_the_launcher(lines[final[0] + 1:]), lines[final[0]:]
    step, path = int(last.group(1)), Path(last.group(2))
    checkpoints = ctrl_c["out"] / "checkpoints"
    assert path == checkpoints / f"global_step{step}" and (checkpoints / "latest").read_text() == path.name
    assert json.loads((path / "hybrid3d.json").read_text())["step"] == step
    records = [json.loads(r) for r in (ctrl_c["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, step + 1))  # recorded, though not echoed after the signal
    interrupted = [i for i, line in enumerate(lines) if line.startswith("KeyboardInterrupt")]  # the runner's
    after_signal = lines[interrupted[-1]:] if interrupted else []
    assert not [line for line in after_signal if re.match(r"step \d+/", line)], after_signal


def run_python(args, cwd, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=python_env(),
                          timeout=timeout)


def test_plain_python_runs_as_one_rank_and_writes_nothing_into_the_checkpoint(ctrl_c, tmp_path):
    """No launcher: the TP2 x PP2 layout says how to launch it; at TP1 x PP1 the Ctrl-C checkpoint evaluates through
    the universal checkpoint without writing into its folder; a second run into the folder is refused, a resume
    below the checkpoint's step too (those two as jobs in the pooled world: their subject is the job's rule)."""
    config, checkpoints = ctrl_c["config"], ctrl_c["out"] / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    needs = run_python([str(TRAIN), "--deepspeed_config", str(config)], tmp_path)
    assert needs.returncode == 2 and "Traceback" not in needs.stderr, needs.stderr[-3000:]
    assert needs.stderr.strip().splitlines()[-1] == (
        "error: hybrid3d.tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 ranks and this is a single "
        "process: launch with `deepspeed --num_gpus 4 launch/train.py --deepspeed_config ...` (a multiple of 4 "
        "adds data parallelism)")
    one = ["--tensor_parallel_size", "1", "--pipeline_parallel_size", "1"]
    evaluated = run_python([str(TRAIN), "--deepspeed_config", str(config), *one, "--checkpoint.load", str(checkpoints),
                            "--eval-only"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in evaluated.stdout and "mpi4py" not in evaluated.stderr
    assert re.search(r"eval_loss \S+ perplexity", evaluated.stdout)
    assert sorted(p.name for p in checkpoints.iterdir()) == before  # no <tag>_universal, no latest_universal

    # the refusals are the job's, not the process's: in the pooled world of 1 (tests/launcher/in_world.py)
    again = run_job(1, config, *one)  # the same folder, no resume
    assert again.returncode == 2 and "holds a previous run" in again.stderr and "--train.overwrite true" in again.stderr
    below = run_job(1, config, *one, "--checkpoint.load", "latest", "--train.steps", "1")
    assert below.returncode == 2 and "is not above the step of the checkpoint" in below.stderr, below.stderr[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == before


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block after `heading` in the README, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(heading):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_hugging_face_commands_run_as_written(tmp_path):
    """The README's convert / verify / fine-tune / export commands, word for word, in a folder laid out like a
    fresh clone, with a tiny random Llama as `Llama-3.2-1B`; only the fine-tune's step count is cut to 2 and each
    launcher gets a free port (other jobs may hold the default)."""
    from transformers import AutoTokenizer

    from hybrid3d.data.builtin import builtin_tokenizer_path
    from tests.distributed.worlds import free_port
    from tests.tiny_llama import make_hf_llama

    for name in ("launch", "ds_configs"):
        (tmp_path / name).symlink_to(REPO / name)
    tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    make_hf_llama(str(tmp_path / "Llama-3.2-1B"), "gqa_llama3", vocab_size=len(tokenizer), max_position_embeddings=256)
    tokenizer.save_pretrained(tmp_path / "Llama-3.2-1B")
    commands = readme_block("## Hugging Face checkpoints in and out")
    assert len(commands) == 4 and "--model.hf_model" in commands[2] and "ds_configs/cpu_demo.json" in commands[2]
    for command in commands:
        argv = shlex.split(command.split("#")[0])
        if argv[0] == "deepspeed":
            argv = [*deepspeed_launcher(), "--master_port", str(free_port()), *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        if "launch/train.py" in argv:
            argv += ["--train.steps", "2"]
        result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=python_env(), timeout=600)
        assert result.returncode == 0, (command, result.stdout[-3000:] + result.stderr[-3000:])
        if "launch/train.py" in argv:
            assert 'hybrid3d.model.preset: "tiny" -> null (replaced by --model.hf_model' in result.stdout
    assert (tmp_path / "llama-finetuned" / "model.safetensors").is_file()

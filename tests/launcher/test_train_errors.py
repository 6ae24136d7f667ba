"""User errors through the real `deepspeed` launcher: the exit code reaches the shell, before and
after the process group starts, with one line and nothing written."""

from tests.launcher.harness import launch
from tests.launcher.in_world import run_job
from tests.configs import h, write_config


def test_launcher_passes_the_exit_code_through(tmp_path):
    config = write_config(tmp_path, lambda c: h(c)["train"].update(stepz=3))
    result = launch(2, config, timeout=300)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("error: hybrid3d.train.stepz is not a known key") == 1
    assert not (tmp_path / "out").exists()


def test_data_error_after_start_up_is_one_line_and_writes_nothing(tmp_path):
    """Data is read after the process group starts (rank 0 first); its errors still end every
    rank with a single line and exit code 2 before the output folder exists."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = write_config(tmp_path, lambda c: h(c)["data"].update(path=str(empty), eval_fraction=0.0,
                                                                  ) or h(c)["train"].update(eval_interval=0))
    result = run_job(2, config, "--tensor_parallel_size", "2", "--pipeline_parallel_size", "1", timeout=300)
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line and "empty" in line]
    assert len(errors) == 1 and errors[0].startswith("error: hybrid3d.data.path:") and "holds no documents" in errors[0]
    assert not (tmp_path / "out").exists()


def test_launcher_flag_after_the_script_is_refused(tmp_path):
    """`deepspeed launch/train.py ... --num_gpus 2`: the runner hands the flag to the script (and would run on
    every local device); the script refuses it with a hint, before anything is written."""
    config = write_config(tmp_path)
    result = run_job(2, config, "--tensor_parallel_size", "2", "--pipeline_parallel_size", "1", "--num_gpus", "2",
                    timeout=300)
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: --num_gpus is a flag of the deepspeed launcher, which passes it on to the script when "
                      "it comes after it: put it before the script (deepspeed --num_gpus 2 launch/train.py ...)"]
    assert not (tmp_path / "out").exists()

"""Every command of the package starts quiet: its first line is its own (the usage, for `--help`), not DeepSpeed's
accelerator detection, which `import deepspeed` logs once per process (ds_internals/quiet_start.py holds it back).

The commands are found, not listed: every module of the package that runs as `python -m` (a `__main__.py`, or an
`if __name__ == "__main__":` block) and `launch/train.py`. Each runs in a fresh interpreter, since the line is logged
at the first import of DeepSpeed in a process."""

import ast
import subprocess
import sys

import pytest

import hybrid3d
from tests.launcher.harness import REPO, TRAIN

PACKAGE = REPO / "hybrid3d"
DEEPSPEED_LOG_MARKS = ("[WARNING]", "[INFO]", "real_accelerator.py")


def runs_as_main(path) -> bool:
    if path.name == "__main__.py":
        return True
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return True
    return False


def commands() -> list[list[str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if runs_as_main(path):
            parts = path.relative_to(REPO).with_suffix("").parts
            found.append(["-m", ".".join(parts[:-1] if parts[-1] == "__main__" else parts)])
    return found + [[str(TRAIN)]]


def test_the_walk_finds_the_documented_commands():
    names = {" ".join(c) for c in commands()}
    assert {"-m hybrid3d.plan", "-m hybrid3d.convert", "-m hybrid3d.verify", "-m hybrid3d.pretrained",
            "-m hybrid3d.data.preprocess", str(TRAIN)} <= names, names
    assert hybrid3d.__file__.startswith(str(PACKAGE))  # the checkout's package is the one walked


@pytest.mark.parametrize("command", commands(), ids=lambda c: c[-1].rsplit("/", 1)[-1])
def test_every_command_starts_with_its_own_line(command):
    result = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-2000:]
    assert output.startswith("usage: "), output[:500]
    assert not [line for line in output.splitlines() if any(mark in line for mark in DEEPSPEED_LOG_MARKS)], output

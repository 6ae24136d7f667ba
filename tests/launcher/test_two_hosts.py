"""Two hosts, launched the ordinary DeepSpeed way: `deepspeed --hostfile H --launcher pdsh launch/train.py ...`
on node0, pdsh reaching node0 and node1 over ssh (two network namespaces with their own sshd and host name,
`two_hosts.py`). This proves what `test_multinode.py` (one launcher per node, `--no_ssh`) cannot: that the job
runs as DeepSpeed's multi-node runner starts it, with only the variables the runner exports and `.deepspeed_env`
carries reaching the remote ranks, gloo talking across a real link between two addresses, and each rank on the
host the hostfile gives it. The 4-rank TP2xPP2 demo must train exactly like the single-host run (its resume
across nodes is test_multinode.py's).

Slow like every test in tests/launcher (tests/conftest.py marks the folder). Skips only without root, without
network namespaces, or when sshd/pdsh are missing and cannot be installed.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.harness import (REPO, TRAIN, _port, config_copy, deepspeed_launcher, launch_env,
                                    launcher_env_by_rank, read_metrics)
from tests.launcher.two_hosts import ADDRS, IFNAME, NAMES, TwoHosts, missing_requirement

HOSTFILE = "".join(f"{name} slots=2\n" for name in NAMES)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    with TwoHosts(tmp_path_factory.mktemp("hosts")) as two:
        yield two


def job_dir(tmp: Path, uninterrupted) -> Path:
    """The single-host run's config with its own output folder, a hostfile, and the `.deepspeed_env` DeepSpeed
    reads from the launch folder (and from ~) and exports on every node."""
    config_copy(uninterrupted["config"], tmp / "config.json", tmp / "run")
    (tmp / "hostfile").write_text(HOSTFILE)
    bin_dir = str(Path(sys.executable).parent)
    # DeepSpeed's JIT-built ops where this session keeps them (tests/op_builds.py built them there): without it the
    # remote ranks look in the default cache, and build the shared-memory op again there if this session's cache is
    # elsewhere (measured: the test took 59 s instead of 15 s)
    ops = os.environ.get("TORCH_EXTENSIONS_DIR")
    # KEY=VALUE lines, no blank ones (DeepSpeed splits every line on '=')
    (tmp / ".deepspeed_env").write_text(
        f"GLOO_SOCKET_IFNAME={IFNAME}\n"  # the link between the hosts; the same name in both namespaces
        f"PYTHONPATH={REPO}\n"  # this checkout, whatever the editable install points at
        "OMP_NUM_THREADS=1\n"  # 4 ranks share 2 cores
        f"PATH={bin_dir}:{os.environ['PATH']}\n"  # an ssh session starts with the login shell's PATH
        + (f"TORCH_EXTENSIONS_DIR={ops}\n" if ops else ""))
    return tmp


def launch_pdsh(hosts: TwoHosts, cwd: Path, *overrides: str, timeout: int = 600) -> tuple[int, str]:
    """`deepspeed --hostfile` on node0, in `cwd` (the remote ranks `cd` to the same path: a shared file system)."""
    cmd = [*deepspeed_launcher(), "--hostfile", str(cwd / "hostfile"), "--no_ssh_check", "--master_addr", ADDRS[0],
           "--master_port", str(_port()), "--launcher", "pdsh", str(TRAIN),
           "--deepspeed_config", str(cwd / "config.json"), *overrides]
    # pdsh runs `ssh <PDSH_SSH_ARGS_APPEND> host cmd`; DeepSpeed keeps the variable (it only adds -p for --ssh_port)
    env = dict(launch_env(), PDSH_SSH_ARGS_APPEND=f"-F {hosts.ssh_config}")
    proc = subprocess.Popen(hosts.in_host(0, cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # launcher and pdsh; remote ranks go with the hosts' teardown
        output = proc.communicate(timeout=30)[0]
        pytest.fail(f"launch timed out after {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output


def test_pdsh_launch_across_two_hosts_trains_like_one_host(hosts, uninterrupted, tmp_path):
    cwd = job_dir(tmp_path, uninterrupted)
    code, output = launch_pdsh(hosts, cwd)
    assert code == 0, output[-4000:]

    # each rank on the host the hostfile gives it, numbered node by node
    places = json.loads((cwd / "run" / "placement.json").read_text())
    assert [p["host"] for p in places] == ["node0", "node0", "node1", "node1"], places
    assert [p["env"] for p in places] == launcher_env_by_rank(nodes=2, slots=2)
    assert [(p["stage"], p["tp"]) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # TP inside, PP across
    # the same losses as the single-host run, to the bit (fp32; the same ranks do the same work)
    assert [m["loss"] for m in read_metrics(cwd / "run")] == [m["loss"] for m in uninterrupted["metrics"]]
    # A resume across the two hosts is not launched again here: it loads the same files in the same 2 x 2 placement
    # as test_multinode.py's resume on two nodes, which checks it to the bit.

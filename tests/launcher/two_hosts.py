"""Two "hosts" on one machine, for DeepSpeed's ssh-based multi-node launchers.

Each host is a Linux network namespace with its own address on a shared veth link (both ends named
`h3d0`, so one GLOO_SOCKET_IFNAME fits every node) and an sshd in its own UTS namespace, so everything started
through ssh (and so every rank) sees that host's name. The file system is shared, as a cluster's would be.
ssh reaches the hosts with a throwaway key and a private client config; nothing in ~/.ssh or /etc is changed
(except the empty /run/sshd that sshd insists on).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

NAMES = ("node0", "node1")
ADDRS = ("10.77.0.1", "10.77.0.2")
IFNAME = "h3d0"
PACKAGES = ("openssh-server", "pdsh", "iproute2")


def missing_requirement() -> str | None:
    """Why this machine cannot host the two nodes (the reason to skip), or None. launch/test.sh installs
    sshd, pdsh and ip where it can (root on Debian)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    if not (Path("/usr/sbin/sshd").exists() and shutil.which("pdsh") and shutil.which("ip")):
        return f"needs {' '.join(PACKAGES)} (bash launch/test.sh installs them as root on Debian)"
    probe = f"h3dprobe{os.getpid()}"
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return "this machine does not allow network namespaces (ip netns add failed)"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd: list[str], check: bool = True, timeout: int = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


class TwoHosts:
    """`with TwoHosts(tmp) as hosts:` node0 and node1 answer ssh (config `hosts.ssh_config`) until the block ends."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.netns = tuple(f"h3d{os.getpid()}n{i}" for i in range(2))  # unique per test process
        self.ssh_config = tmp / "ssh_config"
        self.sshd: list[subprocess.Popen] = []
        self.made_run_sshd = False

    def in_host(self, node: int, cmd: list[str]) -> list[str]:
        """`cmd` run on host `node`: in its network namespace, in a fresh UTS namespace named like the host."""
        return ["ip", "netns", "exec", self.netns[node], "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', NAMES[node], *cmd]

    def __enter__(self) -> "TwoHosts":
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _network(self) -> None:
        for ns in self.netns:
            _run(["ip", "netns", "add", ns])
        # one veth pair, an end in each namespace, both ends called h3d0
        _run(["ip", "link", "add", IFNAME, "netns", self.netns[0], "type", "veth", "peer", "name", IFNAME,
              "netns", self.netns[1]])
        for ns, addr in zip(self.netns, ADDRS):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])

    def _ssh(self) -> None:
        keys = self.tmp / "keys"
        keys.mkdir()
        for name in ("host", "client"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)])
        shutil.copy(keys / "client.pub", keys / "authorized_keys")
        self.made_run_sshd = not Path("/run/sshd").exists()
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for node, addr in enumerate(ADDRS):
            config = self.tmp / f"sshd_{node}.conf"
            config.write_text(f"ListenAddress {addr}\nPort 22\nHostKey {keys / 'host'}\n"
                              f"AuthorizedKeysFile {keys / 'authorized_keys'}\nStrictModes no\n"
                              "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
                              f"PidFile {self.tmp / f'sshd_{node}.pid'}\n")
            log = open(self.tmp / f"sshd_{node}.log", "w")
            self.sshd.append(subprocess.Popen(self.in_host(node, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
                                              stdout=log, stderr=subprocess.STDOUT))
        self.ssh_config.write_text("".join(f"Host {name}\n  HostName {addr}\n" for name, addr in zip(NAMES, ADDRS))
                                   + f"Host *\n  IdentityFile {keys / 'client'}\n  IdentitiesOnly yes\n"
                                   "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
        for node, addr in enumerate(ADDRS):
            self._wait_for_port(node, addr)
        # the whole chain once, from node0 (where the launcher runs): key, config, the remote host name
        for node, name in enumerate(NAMES):
            answer = _run(["ip", "netns", "exec", self.netns[0], "ssh", "-F", str(self.ssh_config), name, "hostname"])
            assert answer.stdout.strip() == name, answer

    def _wait_for_port(self, node: int, addr: str, timeout: float = 30) -> None:
        probe = [sys.executable, "-c", "import socket, sys; socket.create_connection((sys.argv[1], 22), 1)", addr]
        deadline = time.time() + timeout
        while _run(["ip", "netns", "exec", self.netns[node], *probe], check=False).returncode != 0:
            if time.time() > deadline or self.sshd[node].poll() is not None:
                raise RuntimeError(f"sshd on {NAMES[node]} did not start: "
                                   + (self.tmp / f"sshd_{node}.log").read_text())
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the sshds (by pid file), kill whatever is left in the namespaces (ranks of a failed run, which
        live under sshd sessions, not under the launcher), and delete the namespaces with their veth."""
        for node, proc in enumerate(self.sshd):
            pid_file = self.tmp / f"sshd_{node}.pid"
            if pid_file.exists():
                _kill(int(pid_file.read_text()), signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for ns in self.netns:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                _kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", ns], check=False)  # also removes the veth pair
        if self.made_run_sshd:
            shutil.rmtree("/run/sshd", ignore_errors=True)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass

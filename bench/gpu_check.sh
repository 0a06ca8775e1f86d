#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (see ../shared/device/README.md): everything a GPU
# can tell about the GPU path in at most 8 minutes (issue 39's goals): a bf16 smoke run, tiny_grpo's
# bf16 rollout/training mismatch with and without rollout.batch_invariant, the mask and host-sync
# probe (bench/gpu_probe.py), the rollout and GRPO-vs-TRL benchmarks with MFU, the CUDA suite's
# largest part that fits, and FP8 where Transformer Engine is there. Every phase has its own time
# limit and a failure never stops the next one. After each phase the logs are packed into
# $OUT/results.tar.gz (the device tool returns at most 8 files), and $OUT/summary.txt says which
# phase passed in how long, with the mismatch numbers.
#
#   here:   ../shared/device/fetch_wheels.sh math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
#               trl==1.16.0 accelerate datasets pyarrow dill multiprocess xxhash fsspec
#   device: run with carry [".whl"] and command "bash bench/gpu_check.sh [phase ...]"
#           (phases: smoke mismatch probe bench trl tests fp8; default: all, in that order)
#   here, on the CPU: bash bench/gpu_check.sh --dry-run   (every phase at toy size, about a minute;
#           tests/test_gpu_path.py runs it)
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${OUT:-/tmp/gpu_check}
LOGS=${LOGS:-/tmp/gpu_logs}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$LOGS"
: > "$OUT/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ $DRY = 0 ]; then
  export PYTHONPATH=/tmp/site:$PWD
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$LOGS/pip.log" 2>&1 \
      || { cat "$LOGS/pip.log" > "$OUT/summary.txt"; exit 1; }
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'megatron-core', m.__version__)"
  } > "$LOGS/gpu.txt" 2>&1
  cp "$LOGS/gpu.txt" "$OUT/summary.txt"
else
  echo "dry run on the CPU: every phase at toy size" > "$OUT/summary.txt"
fi
# size VALUE_ON_A_GPU VALUE_IN_A_DRY_RUN
size() { if [ $DRY = 1 ]; then echo "$2"; else echo "$1"; fi; }

phase() {  # phase NAME SECONDS COMMAND...: run with a time limit, log, record the outcome, pack the logs
  local name=$1 limit=$2 start=$SECONDS; shift 2
  echo "== $name: $*" >> "$LOGS/$name.log"
  timeout "$limit" "$@" >> "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >> "$OUT/summary.txt"
  tar -czf "$OUT/results.tar.gz" -C "$LOGS" --exclude=checkpoints --exclude=data --exclude=hf_assets . 2>/dev/null
  return $rc
}
TRAIN="$PY train.py --recipe"
QUIET="logging.progress=false logging.tensorboard=false checkpoint.save_every=0"

smoke() {
  phase sft_bf16 45 $TRAIN tiny_sft $QUIET train.max_steps=$(size 20 2) train.eval_every=0 train.precision=bf16 \
      logging.run_dir="$LOGS/sft_bf16"
}
mismatch_of() {  # the run's rollout/training logprob mismatch, into the summary
  $PY -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl')]; \
rows = [r for r in rows if 'rollout/logprob_mismatch_max' in r]; \
print(sys.argv[2], 'mismatch max', max(r['rollout/logprob_mismatch_max'] for r in rows), \
'mean', sum(r['rollout/logprob_mismatch_mean'] for r in rows) / len(rows))" "$1" "$2" >> "$OUT/summary.txt" 2>&1
}
mismatch() {  # tiny_grpo in bf16 from scratch (mean <= 1e-3, max <= 5e-2 is the goal), then batch-invariant
  local steps=$(size 3 1)
  phase grpo_bf16 60 $TRAIN tiny_grpo $QUIET checkpoint.load= train.max_steps=$steps train.precision=bf16 \
      logging.run_dir="$LOGS/grpo_bf16" && mismatch_of "$LOGS/grpo_bf16" bf16
  phase grpo_bf16_invariant 60 $TRAIN tiny_grpo $QUIET checkpoint.load= train.max_steps=$steps train.precision=bf16 \
      rollout.batch_invariant=true logging.run_dir="$LOGS/grpo_bf16_invariant" \
      && mismatch_of "$LOGS/grpo_bf16_invariant" "bf16 batch-invariant"
}
probe() {
  phase probe 60 $PY bench/gpu_probe.py --json "$LOGS/probe.json"
}
bench() {
  phase rollout_b64 90 $PY bench/rollout_throughput.py --batch $(size 64 4) --new-tokens $(size 64 8) \
      --size $(size 25m tiny) --repeats $(size 3 1) --json "$LOGS/rollout_b64.json"
}
trl() {  # GRPO against TRL's GRPOTrainer, both on the GPU in bf16 (TRL from the carried wheels); reports MFU
  if [ $DRY = 1 ]; then
    phase grpo_vs_trl 60 $PY bench/grpo_vs_trl.py --ours-only --prompts 4 --n 4 --new-tokens 8 --seq-length 32 \
        --steps 2 --repeats 1 --threads 1
  else
    phase grpo_vs_trl 150 $PY bench/grpo_vs_trl.py --precision bf16 --trl-python $PY --threads 16 \
        --steps 3 --repeats 2 --out "$LOGS/grpo_vs_trl.json"
  fi
}
tests() {  # the CUDA suite's largest part that fits: the GPU path's own tests first
  if [ $DRY = 1 ]; then
    phase pytest 60 $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu_path.py -k "not dry_run"
  else
    phase pytest 75 $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu_path.py tests/test_losses.py \
        tests/test_paged_attention.py tests/test_packing.py
  fi
}
fp8() {  # needs Transformer Engine, which the lent machine lacks (it cannot be built there in the time)
  if $PY -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
    phase fp8 120 $TRAIN tiny_grpo $QUIET checkpoint.load= train.max_steps=2 train.precision=bf16 fp8.format=hybrid \
        fp8.recipe=tensorwise algorithm.mismatch_correction=token_truncate logging.run_dir="$LOGS/fp8"
  else
    echo "fp8 skipped: no Transformer Engine on this machine" >> "$OUT/summary.txt"
  fi
}
for p in "${@:-smoke mismatch probe bench trl tests fp8}"; do for q in $p; do $q; done; done
cat "$OUT/summary.txt"

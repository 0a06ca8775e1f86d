#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (see ../shared/device/README.md): install the
# wheels carried in .whl/, smoke-train on CUDA, run the benchmarks, then the CUDA-capable tests.
# Every phase has its own time limit and a failure never stops the next one. After each phase the
# logs are packed into $OUT/results.tar.gz (the device tool returns at most 8 files), and
# $OUT/summary.txt says which phase passed in how long.
#
#   here:   ../shared/device/fetch_wheels.sh math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
#               trl==1.16.0 accelerate datasets pyarrow dill multiprocess xxhash fsspec
#   device: run with carry [".whl"] and command "bash bench/gpu_check.sh [phase ...]"
#           (phases: smoke bench trl tests fp8; default: all, in that order; BATCHES and PYTEST_S
#           shorten the rollout benchmark and the test phase)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
LOGS=/tmp/gpu_logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$LOGS/pip.log" 2>&1 \
    || { cat "$LOGS/pip.log" > "$OUT/summary.txt"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'megatron-core', m.__version__)"
} > "$LOGS/gpu.txt" 2>&1
cp "$LOGS/gpu.txt" "$OUT/summary.txt"

phase() {  # phase NAME SECONDS COMMAND...: run with a time limit, log, record the outcome, pack the logs
  local name=$1 limit=$2 start=$SECONDS; shift 2
  echo "== $name: $*" >> "$LOGS/$name.log"
  timeout "$limit" "$@" >> "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >> "$OUT/summary.txt"
  tar -czf "$OUT/results.tar.gz" -C "$LOGS" --exclude=checkpoints --exclude=data --exclude=hf_assets . 2>/dev/null
}
TRAIN="python3 train.py --recipe"

smoke() {
  phase sft_fp32 60 $TRAIN tiny_sft logging.progress=false train.max_steps=20 train.precision=fp32 logging.run_dir="$LOGS/sft_fp32"
  phase sft_bf16 60 $TRAIN tiny_sft logging.progress=false train.max_steps=20 train.precision=bf16 logging.run_dir="$LOGS/sft_bf16"
  phase grpo 90 $TRAIN tiny_grpo logging.progress=false checkpoint.load= train.max_steps=3 train.precision=fp32 logging.run_dir="$LOGS/grpo"
  phase grpo_bf16 90 $TRAIN tiny_grpo logging.progress=false checkpoint.load= train.max_steps=3 train.precision=bf16 \
      logging.run_dir="$LOGS/grpo_bf16"
}
bench() {
  for batch in ${BATCHES:-64 256}; do
    phase "rollout_b$batch" 90 python3 bench/rollout_throughput.py --batch $batch --repeats 3 \
        --json "$LOGS/rollout_b$batch.json"
  done
}
trl() {  # GRPO against TRL's GRPOTrainer, both on the GPU in bf16 (TRL from the carried wheels); reports MFU
  phase grpo_vs_trl 240 python3 bench/grpo_vs_trl.py --precision bf16 --trl-python python3 --threads 16 \
      --steps 3 --repeats 2 --out "$LOGS/grpo_vs_trl.json"
}
tests() {
  phase pytest ${PYTEST_S:-240} python3 -m pytest -q -p no:cacheprovider --timeout 90 tests/test_losses.py tests/test_config.py \
      tests/test_convert.py tests/test_latent_attention.py -k "not layouts and not cli and not learns"
}
fp8() {  # needs Transformer Engine, which the lent machine lacks (it cannot be built there in the time)
  if python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
    phase fp8 180 $TRAIN tiny_grpo logging.progress=false checkpoint.load= train.max_steps=2 train.precision=bf16 fp8.format=hybrid \
        fp8.recipe=tensorwise algorithm.mismatch_correction=token_truncate logging.run_dir="$LOGS/fp8"
  else
    echo "fp8 skipped: no Transformer Engine on this machine" >> "$OUT/summary.txt"
  fi
}
for p in "${@:-smoke bench trl tests fp8}"; do for q in $p; do $q; done; done
ls -la "$OUT"

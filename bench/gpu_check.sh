#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (see ../shared/device/README.md): install the
# wheels carried in .whl/, run the test suite on CUDA, then the rollout and GRPO-vs-TRL benchmarks; results go
# to $OUT (pytest log, benchmark JSON) for BENCHMARKS.md.
#
#   here:   ../shared/device/fetch_wheels.sh math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
#               trl==1.16.0 accelerate datasets pyarrow dill multiprocess xxhash fsspec
#   device: run with carry [".whl"] and command "bash bench/gpu_check.sh"
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" >> "$OUT/gpu.txt" 2>&1
# The suite on CUDA (multi-rank tests use gloo-free paths only where one GPU suffices).
timeout 420 python3 -m pytest -q -x tests/test_losses.py tests/test_config.py tests/test_convert.py \
    -k "not other_layouts and not cli" > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.txt"
for batch in 64 256; do
  timeout 240 python3 bench/rollout_throughput.py --batch $batch --json "$OUT/rollout_b$batch.json" \
      > "$OUT/rollout_b$batch.log" 2>&1
done
# One FP8 GRPO run (Transformer Engine needed on the device; otherwise the log says so): the
# rollout/training logprob mismatch under FP8 is in $OUT/fp8/metrics.jsonl.
if python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
  timeout 240 python3 train.py --recipe tiny_grpo checkpoint.load= train.max_steps=2 train.precision=bf16 \
      fp8.format=hybrid fp8.recipe=tensorwise algorithm.mismatch_correction=token_truncate \
      logging.run_dir="$OUT/fp8" logging.progress=false > "$OUT/fp8.log" 2>&1
  # The optimizer's memory settings (megatron's precision-aware optimizer and its CPU offload), two
  # steps each: peak memory and the losses in $OUT/opt_*/metrics.jsonl.
  for setting in "optimizer.state_dtype=bf16" "optimizer.cpu_offload=1"; do
    timeout 120 python3 train.py --recipe tiny_sft train.max_steps=2 train.precision=bf16 optimizer.distributed=true \
        "$setting" logging.run_dir="$OUT/opt_${setting#optimizer.}" logging.progress=false \
        > "$OUT/opt_${setting#optimizer.}.log" 2>&1
  done
else
  echo "no Transformer Engine on this machine: the FP8 and optimizer-memory steps were not run" > "$OUT/fp8.log"
fi
# GRPO against TRL's GRPOTrainer, both on the GPU in bf16 (TRL from the carried wheels); reports MFU.
timeout 300 python3 bench/grpo_vs_trl.py --precision bf16 --trl-python python3 --threads 16 --steps 3 --repeats 2 \
    --out "$OUT/grpo_vs_trl.json" > "$OUT/grpo_vs_trl.log" 2>&1
ls -la "$OUT"

#!/usr/bin/env bash
# Every GPU check of this project in one run (the device tool lends a GPU for minutes, not hours).
# Usage on a CUDA machine with torch, transformers, peft, msgpack, pytest already installed:
#   OUT=/some/dir bash benchmarks/gpu_checks.sh
# Results land in $OUT: gpu.txt, unit.log, recipe.log + recipe-metrics.jsonl, data_plane.json, weight_sync.json.
set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/asyncrl-gpu}
mkdir -p "$OUT"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" >> "$OUT/gpu.txt" 2>&1

# 1. unit tests, including the CUDA logprob-alignment test (vLLM tests skip: vllm is not installed there)
timeout 150 python3 -m pytest tests/unit -q -x -p no:cacheprovider -m "not vllm" > "$OUT/unit.log" 2>&1
echo "unit rc=$?" >> "$OUT/gpu.txt"

# 2. the recipe with trainer and HF rollout worker on the GPU (1 rank: NCCL needs one GPU per rank)
timeout 170 python3 -m torch.distributed.run --standalone --nproc-per-node 1 recipes/grpo.py \
  --config recipes/configs/tiny_cpu.yaml run_dir="$OUT/recipe" rollout.worker.engine.device=cuda \
  train.steps=100 checkpoint.every=50 > "$OUT/recipe.log" 2>&1
echo "recipe rc=$?" >> "$OUT/gpu.txt"
cp "$OUT/recipe/metrics.jsonl" "$OUT/recipe-metrics.jsonl" 2>/dev/null
rm -rf "$OUT/recipe"

# 3. the data plane on 16 cores with 4 workers (CPU work; shows scaling past the 2-core CI machine)
timeout 90 python3 -m benchmarks.data_plane --workers 4 --seconds 5 --repeats 3 \
  --paths asyncrl,mp_queue,zmq_raw --out "$OUT/data_plane.json" > "$OUT/data_plane.log" 2>&1
echo "data_plane rc=$?" >> "$OUT/gpu.txt"

# 4. weight-sync bandwidth up to 1 GB with 16 cores and 128 GiB
timeout 100 python3 -m benchmarks.weight_sync --max-gb 1 --out "$OUT/weight_sync.json" > "$OUT/weight_sync.log" 2>&1
echo "weight_sync rc=$?" >> "$OUT/gpu.txt"
true

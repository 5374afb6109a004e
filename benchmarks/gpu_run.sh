#!/usr/bin/env bash
# Module 5's GPU measurements in one call (a few minutes on one H100/H200, jax with CUDA installed):
# attention forward+backward TFLOP/s per implementation (causal, bf16, head_dim 128), the MFU of
# configs/llama_1b.py with each attention choice, and the overlap of each strategy on every local GPU
# (benchmarks/overlap.py). Then: jaxpar lab kernels --gpu-results DIR.
#   bash benchmarks/gpu_run.sh runs/gpu
set -uo pipefail
out="${1:-${OUT:-runs/gpu}}"
cd "$(dirname "$0")/.."
python benchmarks/attention.py --out "$out" --seq-lens 1024,2048,4096,8192 --batch 4 --heads 16 --head-dim 128
python benchmarks/mfu.py --out "$out" --steps 8 --batch 8
# Overlap (lab 05): per strategy, the collective time that ran beside compute in a profile of every local GPU,
# beside the compiled schedule's replay (CPU check: python benchmarks/overlap.py --cpu 8 --out DIR).
python benchmarks/overlap.py --out "$out"

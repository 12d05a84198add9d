#!/usr/bin/env bash
# One 4-GPU machine: the GPU test suite (GPU 3), the throughput cost of activation checkpointing (one GPU
# each, GPUs 0 and 1, runtime.activation_checkpointing=none vs blocks) and the Qwen2.5-7B -> 1.5B model
# directories (GPU 2) at once; then, alone on the machine, the 1/2/4-GPU scaling of Qwen2.5-1.5B -> 0.5B
# at 8 x 2048 per GPU. Raw results go to OUT (default ./gpu_scaling), logs into OUT/logs.tgz.
#
#     PYTHONPATH=src:. bash scripts/gpu_scaling.sh OUT
set -uo pipefail
dest=${1:-gpu_scaling}
mkdir -p "$dest"
day=$(date +%F)
pair=qwen2.5-1.5b:qwen2.5-0.5b
e2e() { python3 scripts/gpu_e2e.py --seq-len 2048 --per-gpu-batch 8 --runs 1 "$@"; }
CUDA_VISIBLE_DEVICES=3 python3 -m pytest -m gpu tests/gpu -q >"$dest/gpu_tests.txt" 2>&1 &
for i in 0 1; do
  mode=$([ $i = 0 ] && echo none || echo blocks)
  CUDA_VISIBLE_DEVICES=$i e2e --pair $pair --nproc 1 --steps 30 --work /tmp/ck$i --out /tmp/ck_$mode \
    --extra runtime.activation_checkpointing=$mode >"$dest/ckpt_$mode.txt" 2>&1 &
done
# the bigger pair's model directories, for the next command (gpu_e2e.py --reuse)
CUDA_VISIBLE_DEVICES=2 e2e --pair qwen2.5-7b:qwen2.5-1.5b --make-only --work /tmp/kd7 \
  --out /tmp/kd7_make >"$dest/make_7b.txt" 2>&1 &
wait
for mode in none blocks; do cp "/tmp/ck_$mode/results.json" "$dest/ckpt_${mode}_${day}.json"; done
e2e --pair $pair --nproc 1,2,4 --steps 40 --work /tmp/kd_e2e --out /tmp/scale >"$dest/scaling.txt" 2>&1
cp /tmp/scale/results.json "$dest/scaling_${day}.json"
tail -3 "$dest/gpu_tests.txt"; tail -3 "$dest"/ckpt_*.txt; tail -5 "$dest/scaling.txt"; tail -2 "$dest/make_7b.txt"
(cd "$dest" && tar czf logs.tgz ./*.txt && rm -f ./*.txt)

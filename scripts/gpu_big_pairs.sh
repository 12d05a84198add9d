#!/usr/bin/env bash
# One 4-GPU machine, after scripts/gpu_scaling.sh: the FP8 and training GPU tests (GPU 0) while the
# Qwen2.5-7B -> 1.5B model directories are written (GPU 1); four-GPU runs of Qwen2.5-1.5B -> 0.5B with
# the student's blocks kept gathered (profiled) and regathered in backward; then the 1/2/4-GPU scaling
# of Qwen2.5-7B -> 1.5B at 8 x 2048 per GPU. Raw results go to OUT (default ./gpu_big), logs and step
# profiles into OUT/logs.tgz.
#
#     PYTHONPATH=src:. bash scripts/gpu_big_pairs.sh OUT
set -uo pipefail
dest=${1:-gpu_big}
mkdir -p "$dest"
day=$(date +%F)
e2e() { python3 scripts/gpu_e2e.py --seq-len 2048 --per-gpu-batch 8 --runs 1 "$@"; }
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu tests/gpu/test_fp8_gpu.py tests/gpu/test_train_gpu.py -q \
  >"$dest/gpu_tests.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 e2e --pair qwen2.5-7b:qwen2.5-1.5b --make-only --work /tmp/kd7 --out /tmp/kd7_make \
  >"$dest/make_7b.txt" 2>&1 &
wait
small=qwen2.5-1.5b:qwen2.5-0.5b
e2e --pair $small --nproc 4 --steps 30 --work /tmp/kd_e2e --out /tmp/kept \
  --extra runtime.profile_steps=2 >"$dest/four_kept.txt" 2>&1
e2e --pair $small --nproc 4 --steps 30 --work /tmp/kd_e2e --reuse --out /tmp/regather \
  --extra runtime.student_reshard=after_forward >"$dest/four_regathered.txt" 2>&1
cp /tmp/kept/results.json "$dest/four_kept_${day}.json"
cp /tmp/regather/results.json "$dest/four_regathered_${day}.json"
cp /tmp/kept/run0_profile_rank0.txt "$dest/four_kept_profile_rank0.txt"
e2e --pair qwen2.5-7b:qwen2.5-1.5b --nproc 1,2,4 --steps 20 --work /tmp/kd7 --reuse --out /tmp/s7 \
  >"$dest/scaling_7b.txt" 2>&1
cp /tmp/s7/results.json "$dest/scaling_7b_${day}.json"
tail -n 3 "$dest/gpu_tests.txt"
for f in four_kept four_regathered scaling_7b; do tail -n 5 "$dest/$f.txt"; done
(cd "$dest" && tar czf logs.tgz ./*.txt && rm -f ./*.txt)

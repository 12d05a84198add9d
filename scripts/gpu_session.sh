#!/usr/bin/env bash
# One GPU machine, several measurements at once (4 GPUs): the throughput benchmark on GPU 0, the GPU
# test suite on GPU 1, the demo with a bf16 and an FP8 teacher on GPU 2; then the 1/2/4-GPU scaling
# run of scripts/gpu_e2e.py on all four. The raw results go to OUT (default ./gpu_session), the logs
# and step profiles into OUT/logs.tgz.
#
#     PYTHONPATH=src:. bash scripts/gpu_session.sh OUT
set -uo pipefail
dest=${1:-gpu_session}
mkdir -p "$dest"
day=$(date +%F)
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kd_throughput.py --providers triton,triton-fp8,liger,liger-bf16 \
  --batch 8,16 --steps 8 --warmup 3 --json "$dest/kd_throughput_${day}_fp8.json" >"$dest/bench.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m pytest -m gpu tests/gpu -q >"$dest/gpu_tests.txt" 2>&1 &
(
  for p in auto fp8; do
    CUDA_VISIBLE_DEVICES=2 python3 -m kdistill run src/kdistill/demo/demo.yaml runtime.device=cuda \
      "teacher.precision=$p" "output.dir=/tmp/demo_$p" --overwrite --quiet >"$dest/demo_$p.log" 2>&1
    cp "/tmp/demo_$p/summary.json" "$dest/demo_${p}_summary.json"
  done
) &
wait
python3 scripts/gpu_e2e.py --pair qwen2.5-1.5b:qwen2.5-0.5b --seq-len 2048 --per-gpu-batch 8 --nproc 1,2,4 \
  --steps 30 --runs 1 --out /tmp/e2e4 --extra runtime.profile_steps=2 >"$dest/scaling.txt" 2>&1
cp /tmp/e2e4/results.json "$dest/gpu_e2e_scaling_${day}.json"
cp /tmp/e2e4/run*_profile_rank0.txt "$dest/" 2>/dev/null
grep -v -i "warn\|backend impl" "$dest/bench.txt" | tail -16; tail -3 "$dest/gpu_tests.txt"; tail -6 "$dest/scaling.txt"
(cd "$dest" && tar czf logs.tgz ./*.txt ./*.log && rm -f ./*.txt ./*.log)

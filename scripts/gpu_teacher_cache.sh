#!/usr/bin/env bash
# Two-stage distillation on a GPU: the same student trained with the live teacher and from a teacher
# cache (topk and sampled), at the same shapes and steps; student steps/s, held-out loss and bytes per
# token on disk, collected into OUT/teacher_cache.json.
#
#     PYTHONPATH=src:. bash scripts/gpu_teacher_cache.sh OUT [PAIR] [STEPS]
#
# The random-weight model directories and the live run come from scripts/gpu_e2e.py; the data is the
# stdlib corpus capped at data.max_tokens so that caching it takes seconds.
set -euo pipefail
dest=${1:?usage: gpu_teacher_cache.sh OUT [PAIR] [STEPS]}
pair=${2:-qwen2.5-1.5b:qwen2.5-0.5b}
steps=${3:-30}
work=${WORK:-/tmp/kd_tcache}
mkdir -p "$dest"
common=(data.train=stdlib:train data.heldout=stdlib:heldout data.seq_len=2048 data.max_tokens=1200000
  schedule.batch_size=8 "schedule.steps=$steps" schedule.eval_every=0 schedule.eval_batches=4
  schedule.checkpoint_every=0 runtime.strict_kernels=true)
python3 scripts/gpu_e2e.py --pair "$pair" --seq-len 2048 --batch 8 --steps "$steps" --runs 1 \
  --work "$work" --out "$dest/live" --extra data.max_tokens=1200000 schedule.eval_batches=4 >"$dest/live.txt" 2>&1
cat >"$work/run.yaml" <<YAML
teacher: {path: $work/teacher}
student: {path: $work/student, init: pretrained}
YAML
for mode in topk sampled; do
  t0=$(date +%s)
  python3 -m kdistill teacher-cache "$work/run.yaml" "${common[@]}" --mode "$mode" --k 64 --quiet --json \
    --out "$work/cache-$mode" >"$dest/cache-$mode.json"
  echo "cache $mode written in $(($(date +%s) - t0)) s"
  python3 -m kdistill run "$work/run.yaml" --overwrite --quiet "${common[@]}" "teacher.cache=$work/cache-$mode" \
    "output.dir=$work/run-$mode" >"$dest/run-$mode.log" 2>&1
  cp "$work/run-$mode/summary.json" "$dest/summary-$mode.json"
  du -sb "$work/cache-$mode" | cut -f1 >"$dest/bytes-$mode.txt"
done
python3 - "$dest" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
doc = json.loads((out / "live" / "results.json").read_text())
live = doc["results"][0]
rows = [{"mode": "live", "tokens_per_s_steady": live.get("tokens_per_s_steady"),
         "heldout_student_loss": live["heldout"].get("student_loss"), "bytes_per_token": None}]
for mode in ("topk", "sampled"):
    s = json.loads((out / f"summary-{mode}.json").read_text())
    c = json.loads((out / f"cache-{mode}.json").read_text())
    nbytes = int((out / f"bytes-{mode}.txt").read_text())
    rows.append({"mode": mode, "tokens_per_s_steady": s.get("tokens_per_s_steady"),
                 "heldout_student_loss": s["heldout"].get("student_loss"),
                 "bytes_per_token": c.get("bytes_per_token"), "bytes_on_disk": nbytes, "cache": c})
(out / "teacher_cache.json").write_text(json.dumps({"pair": doc.get("pair"), "device": doc.get("device"), "rows": rows}, indent=2))
for r in rows:
    print(r["mode"], r["tokens_per_s_steady"], r["heldout_student_loss"], r["bytes_per_token"])
EOF

#!/usr/bin/env bash
# The install check (called by scripts/test.sh after pytest; alone: `bash scripts/ci_wheel.sh`): build the
# wheel, install it without extras into a clean venv that has no Triton, and run `kdistill run` (the
# embedded demo, 3 steps) and `kdistill eval` on its student there; `kdistill kernels build` must say in
# one line that it needs the `kernels` extra.
# The venv (.venv-wheel) is reused while pyproject.toml and this script are unchanged (a stamp, as in
# scripts/setup.sh); the wheel itself is rebuilt and reinstalled every time. torch==2.13.0 goes in first:
# on the project's machines that is a CPU build on local disk, and installing anything that depends on
# torch before it would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_PY=${BUILD_PY:-.venv/bin/python}  # builds the wheel (has setuptools; no network needed)
VENV=.venv-wheel
WORK=build/ci-wheel
start=$SECONDS

echo "== wheel"
rm -rf "$WORK" build/lib build/bdist.*
mkdir -p "$WORK/dist"
"$BUILD_PY" -m pip wheel . --no-deps --no-build-isolation -q -w "$WORK/dist"
wheel=$(ls "$WORK"/dist/kdistill-*.whl)
"$BUILD_PY" - "$wheel" <<'PYCHECK'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["kdistill/demo/demo.yaml", "kdistill/demo/assets/teacher/model.safetensors",
        "kdistill/demo/assets/teacher/tokenizer.json", "kdistill/demo/assets/student/config.json"]
missing = [n for n in need if n not in names]
sys.exit(f"wheel lacks {missing}" if missing else 0)
PYCHECK

echo "== clean venv without Triton"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.kdistill-wheel-deps"
want=$(sha256sum pyproject.toml scripts/ci_wheel.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
if "$VENV/bin/python" -c "import triton" >/dev/null 2>&1; then
  echo "ci_wheel: Triton is importable in $VENV, expected a venv without it" >&2
  exit 1
fi

echo "== kdistill from the wheel (outside the source tree)"
cd "$WORK"
export KDISTILL_CACHE_DIR="$PWD/data-cache"
kd="../../$VENV/bin/kdistill"
"$kd" --version
"$kd" run schedule.steps=3 schedule.eval_batches=1 schedule.batch_size=2 output.dir=run --quiet
"$kd" eval --model run/student --data stdlib:heldout --max-tokens 2048
set +e
"$kd" kernels build --arch sm_90 ../../src/kdistill/demo/demo.yaml 2> kernels.err
rc=$?
set -e
if [ "$rc" != 2 ] || [ "$(wc -l < kernels.err)" != 1 ] || ! grep -q "kdistill\[kernels\]" kernels.err; then
  echo "ci_wheel: kernels build without Triton: exit $rc, expected exit 2 and one line naming kdistill[kernels]:" >&2
  cat kernels.err >&2
  exit 1
fi
echo "ci_wheel: ok in $((SECONDS - start))s"

#!/usr/bin/env bash
# The README's test command: set up .venv, lint, cross-compile the kernel plans without a GPU (kept as
# a kernel pack in build/kernel-pack), and
# run the test suite (GPU-marked tests are deselected here; run them on a GPU with `-m gpu`), then
# install the built wheel into a clean venv without Triton and run it there (scripts/ci_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests scripts benchmarks
.venv/bin/ruff format --check src tests scripts benchmarks
echo "== kernels build (no GPU): demo pair and qwen2.5-1.5b -> qwen2.5-0.5b, into one kernel pack"
# The demo: the default arch list (sm_103 and sm_121 too where this Triton targets them).
rm -rf build/kernel-pack
.venv/bin/kdistill kernels build src/kdistill/demo/demo.yaml --out build/kernel-pack
.venv/bin/kdistill kernels build --arch sm_80,sm_89,sm_90,sm_100,sm_120 qwen2.5-1.5b:qwen2.5-0.5b --out build/kernel-pack
echo "== kernels build (no GPU): the FP8 teacher's plan for the archs with FP8"
.venv/bin/kdistill kernels build --arch sm_89,sm_90,sm_100,sm_120 qwen2.5-1.5b:qwen2.5-0.5b teacher.precision=fp8
echo "== pytest"
# The preset pair's pack built above: tests/test_kernels.py checks it instead of compiling it again.
export KDISTILL_TEST_PRESET_PACK="$PWD/build/kernel-pack"
.venv/bin/python -m pytest -m "not gpu" -q --durations=15 "$@"
echo "== wheel in a clean venv without Triton"
exec bash scripts/ci_wheel.sh

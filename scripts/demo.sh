#!/usr/bin/env bash
# The README's run command: set up .venv, then `kdistill run` with no arguments (the embedded demo:
# CPU, offline). Extra arguments are passed to `kdistill run` as overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kdistill run "$@"

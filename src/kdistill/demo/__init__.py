"""The embedded default: a shipped teacher and the Python standard library as corpus.

`kdistill run` with no arguments distils `assets/teacher` (about 4M parameters, trained by
scripts/make_demo_teacher.py on the stdlib's train split) into the small student of
`assets/student/config.json`, then trains the same student on hard labels only for the same steps,
and compares held-out losses.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"

# The demo's run config (YAML, paths relative to its folder), sized to finish in well under
# 3 minutes on a 2-core CPU.
DEMO_YAML = Path(__file__).resolve().parent / "demo.yaml"

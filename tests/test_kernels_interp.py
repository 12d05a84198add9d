"""Each Triton kernel vs its PyTorch reference under Triton's interpreter (CPU), forward and backward.

TRITON_INTERPRET=1 must be set before triton is imported, so the cases (tests/test_kernels_interp_cases.py)
run in one subprocess; each case here reads its result. Small and odd shapes, fp32 and bf16,
grad_output != 1, strict triton mode (a silent reference fallback would fail the case).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_kernels_interp_cases import CASES  # noqa: E402

from tests import background  # noqa: E402


def prelaunch(fixturenames: set[str]) -> None:
    """tests/conftest.py: start the interpreter's subprocess in the background (tests/background.py), where
    it runs on a core that the in-process tests leave idle."""
    if "interp_results" in fixturenames:
        background.start("kernels_interp", _interpret)


def _interpret() -> dict:
    env = {**background.environ(), "TRITON_INTERPRET": "1", "KDISTILL_LOG_KERNELS": "0"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "test_kernels_interp_cases.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    assert results, f"interpreter run printed no results: {proc.stderr[-3000:]}"
    return results


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return background.start("kernels_interp", _interpret).result()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_interpreted(interp_results, case):
    r = interp_results.get(case)
    assert r is not None, f"case {case} did not run"
    assert r["ok"], f"{r['error']}\n{r.get('trace', '')}"

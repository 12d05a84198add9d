"""Test-wide settings: kernels run strict (a compile after the seal or a kernel failure is an error)
unless a test asks otherwise; child processes inherit it through the environment."""

import os

os.environ.setdefault("KDISTILL_STRICT_KERNELS", "1")


import pytest  # noqa: E402

from kdistill.kernels import runtime, seal  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dispatcher_state():
    """Each test starts from the dispatcher's default state: a run executed in-process by an earlier
    test (the Python API, the CLI's main) leaves its own mode, strictness and arch configured, and the
    kernel cache sealed."""
    saved = runtime._STATE
    runtime._STATE = runtime.KernelRuntime()
    yield
    runtime._STATE = saved
    seal.unseal()  # a run in this process sealed the kernel cache: the next test starts unsealed

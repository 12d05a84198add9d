"""Test-wide settings: kernels run strict (a compile after the seal or a kernel failure is an error)
unless a test asks otherwise; child processes inherit it through the environment."""

import os

os.environ.setdefault("KDISTILL_STRICT_KERNELS", "1")

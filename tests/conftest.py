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


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    """Modules with a `prelaunch(fixturenames)` function start their fixtures' subprocess batches now, in
    the background, and run last, so the batches use the cores the other tests leave idle
    (tests/background.py). KDISTILL_TEST_BACKGROUND=0 turns that off."""
    if config.option.collectonly or os.environ.get("KDISTILL_TEST_BACKGROUND") == "0":
        return  # KDISTILL_TEST_BACKGROUND=0: file order, each batch started by its fixture
    late: dict = {}  # module -> the fixture names its selected tests use, in the order of the run
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "prelaunch"):
            late.setdefault(module, set()).update(item.fixturenames)
    if not late:
        return
    items[:] = [it for it in items if getattr(it, "module", None) not in late] + [
        it for it in items if getattr(it, "module", None) in late
    ]
    for module, names in late.items():
        try:
            module.prelaunch(names)
        except Exception:  # the fixture prepares its batch again and reports the error in its test
            pass


def pytest_sessionfinish(session, exitstatus):
    from tests import background

    background.cancel_pending()

"""One property suite for every framework and device.

TILE_KERNELS_TEST_DEVICE=cpu (default) runs the real kernels in Triton's interpreter (TRITON_INTERPRET=1 is set here,
before anything imports triton); =gpu runs them compiled on the CUDA/ROCm device. HYPOTHESIS_PROFILE picks dev / ci
(derandomized) / gpu (more examples). Every buffer an op allocates is poisoned with NaN (TILE_KERNELS_POISON=1)."""

import importlib.util
import os

DEVICE = os.environ.setdefault("TILE_KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def _pin_worker_to_one_gpu() -> None:
    """Under pytest-xdist, worker gwK sees only GPU K mod TILE_KERNELS_NUM_GPUS (set by the nox GPU sessions), through
    CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES, before torch or JAX initialize the device."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("TILE_KERNELS_NUM_GPUS", "0"))
    if DEVICE != "gpu" or not worker.startswith("gw") or count < 1:
        return
    var = "HIP_VISIBLE_DEVICES" if os.environ.get("TILE_KERNELS_GPU_VENDOR") == "rocm" else "CUDA_VISIBLE_DEVICES"
    visible = [d for d in os.environ.get(var, "").split(",") if d] or [str(i) for i in range(count)]
    os.environ[var] = visible[int(worker[2:]) % len(visible)]


_pin_worker_to_one_gpu()
os.environ.setdefault("TILE_KERNELS_POISON", "1")
# JAX reserves 75% of a GPU at its start by default: torch and the other xdist workers on that GPU would run out
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402
from drivers import DRIVERS  # noqa: E402

from tile_kernels.core.registry import set_bfloat16_rounding  # noqa: E402

if DEVICE == "cpu":
    set_bfloat16_rounding("truncate")  # the interpreter's float32 -> bfloat16 conversion truncates
# torch.library.opcheck's checks of an op; the AOT-dispatch one traces the ops' host code with symbolic sizes (on the
# CPU the traced ops stay graph nodes that run the interpreted kernels: torch/_runtime.py)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# tests of TileLang kernels' lowering and builds (they run on the CPU, as nvcc builds: no GPU needed)
needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang not installed")


def assert_in_order(text: str, steps) -> None:
    """Each of `steps` occurs in `text` after the previous one (a schedule read in generated code)."""
    at = 0
    for step in steps:
        found = text.find(step, at)
        assert found >= 0, f"{step!r} not found after position {at}"
        at = found + len(step)


needs_torch = pytest.mark.skipif("torch" not in DRIVERS, reason="torch not installed")
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=15, **_common)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=150, derandomize=True, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if DEVICE == "gpu" else "dev"))


@pytest.fixture(params=sorted(DRIVERS), scope="session")
def driver(request):
    return DRIVERS[request.param](DEVICE)


def pytest_configure(config):
    """Under `--dist loadgroup` pytest-xdist keeps an xdist_group on one worker through a suffix it writes into the
    node ids, which pytest 9.2 no longer takes (xdist 3.8): every worker would then run the group's session fixtures
    (minutes of subprocesses in test_distributed.py). The test extra pins pytest below it."""
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
    if getattr(config.option, "dist", None) == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(f"--dist loadgroup does not group tests under pytest {pytest.__version__}: install "
                                "the test extra's pytest (pip install -e '.[test]')")  # fmt: skip


_REPORT_LOG = os.environ.get("TILE_KERNELS_REPORT_LOG")


def pytest_runtest_logreport(report):
    """With TILE_KERNELS_REPORT_LOG=FILE every finished test appends its outcome (and a failure's report) there as it
    ends (written by the controller under xdist), so that a run on a time-boxed GPU machine that is cut off still
    leaves what it found."""
    if not _REPORT_LOG or (report.when != "call" and report.passed) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(_REPORT_LOG, "a") as log:
        log.write(f"{report.outcome.upper()} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        if report.failed:
            log.write(report.longreprtext[-6000:] + "\n\n")

"""One property suite for every framework and device.

TILE_KERNELS_TEST_DEVICE=cpu (default) runs the real kernels in Triton's interpreter (TRITON_INTERPRET=1 is set here,
before anything imports triton); =gpu runs them compiled on the CUDA/ROCm device. HYPOTHESIS_PROFILE picks dev / ci
(derandomized) / gpu (more examples). Every buffer an op allocates is poisoned with NaN (TILE_KERNELS_POISON=1)."""

import os

DEVICE = os.environ.setdefault("TILE_KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TILE_KERNELS_POISON", "1")

import pytest  # noqa: E402
from drivers import DRIVERS  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=15, **_common)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=150, derandomize=True, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if DEVICE == "gpu" else "dev"))


@pytest.fixture(params=sorted(DRIVERS), scope="session")
def driver(request):
    return DRIVERS[request.param](DEVICE)

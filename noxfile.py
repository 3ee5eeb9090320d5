"""Sessions: tests (CPU, Triton interpreter), gpu_tests-cuda, gpu_tests-rocm, aot, example, lint.

`nox -l` lists them. The CPU sessions install torch's CPU build first (TILE_KERNELS_TORCH overrides the requirement),
so that nothing later pulls a multi-GB CUDA build."""

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = os.environ.get("TILE_KERNELS_TORCH", "torch==2.13.0")


def _install_cpu_stack(session):
    session.install(TORCH_CPU)
    session.install("-e", ".[torch,jax,test]")


@nox.session
def tests(session):
    """CPU suite: the real Triton kernels in the interpreter, through torch and JAX (interpret mode)."""
    _install_cpu_stack(session)
    env = {"TILE_KERNELS_TEST_DEVICE": "cpu", "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", "-n", "auto", "--dist", "loadgroup", *session.posargs, env=env)


def _has(session, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return session.run("python", "-c", code, success_codes=[0, 1], silent=True, log=False) is True


def _gpu_tests(session, vendor: str):
    """Uses the torch already installed for the vendor when there is one. Otherwise cuda installs torch from the
    default index, and rocm from the wheel index named by TILE_KERNELS_ROCM_TORCH_INDEX (PyTorch's ROCm index)."""
    if not _has(session, "torch"):
        if vendor == "rocm":
            index = os.environ.get("TILE_KERNELS_ROCM_TORCH_INDEX")
            if not index:
                session.error("no torch present: set TILE_KERNELS_ROCM_TORCH_INDEX to PyTorch's ROCm wheel index")
            session.install("torch", "--index-url", index)
        else:
            session.install("torch")
    session.install("-e", ".[test]", "jax-triton>=0.3.1,<0.5", "ml_dtypes")
    check = (
        "import torch, sys; ok = torch.cuda.is_available() and (torch.version.hip is not None) == {}; sys.exit(not ok)"
    )
    session.run("python", "-c", check.format(vendor == "rocm"), external=True)
    env = {"TILE_KERNELS_TEST_DEVICE": "gpu", "HYPOTHESIS_PROFILE": "gpu", "TRITON_INTERPRET": "0"}
    if vendor == "rocm":
        env["HIP_VISIBLE_DEVICES"] = os.environ.get("HIP_VISIBLE_DEVICES", "0")
    session.run("pytest", *session.posargs, env=env)


@nox.session(name="gpu_tests-cuda", venv_params=["--system-site-packages"])
def gpu_tests_cuda(session):
    """GPU suite on an NVIDIA device: compiled kernels, torch + jax-triton, opcheck, torch.compile."""
    _gpu_tests(session, "cuda")


@nox.session(name="gpu_tests-rocm", venv_params=["--system-site-packages"])
def gpu_tests_rocm(session):
    """GPU suite on an AMD device (HIP_VISIBLE_DEVICES defaults to 0): the same checks on ROCm."""
    _gpu_tests(session, "rocm")


@nox.session
def example(session):
    """The README's example: a Llama block's norm + softmax path in torch and JAX vs the plain frameworks."""
    _install_cpu_stack(session)
    session.run("python", "examples/llama_block.py", *session.posargs)


@nox.session
def aot(session):
    """Compile every kernel configuration for cuda sm_80/90/100 and hip gfx90a/942/950, no GPU needed.
    Arguments go to `tile-kernels aot` (e.g. -- --target hip:gfx942 --out prebuilt/)."""
    session.install("-e", ".")
    session.run("tile-kernels", "aot", *session.posargs, env={"TRITON_INTERPRET": "0"})


@nox.session
def lint(session):
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")

"""Sessions: tests (CPU, Triton interpreter; then aot-oldest-triton), gpu_tests-cuda, gpu_tests-rocm, sanitize-cuda,
bench, aot, aot-oldest-triton, example, lint.

`nox -l` lists them. The CPU sessions install torch's CPU build first (TILE_KERNELS_TORCH overrides the requirement),
so that nothing later pulls a multi-GB CUDA build."""

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = os.environ.get("TILE_KERNELS_TORCH", "torch==2.13.0")
OLDEST_TRITON = "triton==3.6.0"  # pyproject's lower bound (what torch 2.11 pins): its compiler differs from the newest


def _install_cpu_stack(session):
    session.install(TORCH_CPU)
    # tilelang: its kernels lower and nvcc-build in the AOT tests; models: the patched-model and flax module tests
    session.install("-e", ".[torch,jax,test,tilelang,models]")


@nox.session
def tests(session):
    """CPU suite: the real Triton kernels in the interpreter, through torch and JAX (interpret mode); its AOT tests
    compile 2 configurations of every kernel for each target (TILE_KERNELS_AOT=full: every configuration)."""
    _install_cpu_stack(session)
    env = {"TILE_KERNELS_TEST_DEVICE": "cpu", "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", "-n", "auto", "--dist", "loadgroup", *session.posargs, env=env)
    session.notify("aot-oldest-triton")


def _has(session, module: str) -> bool:
    code = f"import importlib.util; print('found' if importlib.util.find_spec({module!r}) else 'missing')"
    return "found" in session.run("python3", "-c", code, silent=True, log=False, external=True)


def _gpu_setup(session, vendor: str) -> dict:
    """Installs what the GPU suite needs and is missing (a machine without a package index can run the session with
    `--no-venv` on a prepared environment): torch from the default index for cuda, from TILE_KERNELS_ROCM_TORCH_INDEX
    (PyTorch's ROCm wheel index) for rocm. Checks the device and returns the suite's environment."""
    if not _has(session, "torch"):
        if vendor == "rocm":
            index = os.environ.get("TILE_KERNELS_ROCM_TORCH_INDEX")
            if not index:
                session.error("no torch present: set TILE_KERNELS_ROCM_TORCH_INDEX to PyTorch's ROCm wheel index")
            session.install("torch", "--index-url", index)
        else:
            session.install("torch")
    if not all(_has(session, m) for m in ("tile_kernels.core", "hypothesis", "xdist", "ml_dtypes")):
        session.install("-e", ".[test]")
    if _has(session, "jax") and not _has(session, "jax_triton"):
        session.install("jax-triton>=0.3.1,<0.5")
    probe = (
        "import torch, sys; hip = torch.version.hip is not None; n = torch.cuda.device_count();"
        f"sys.exit('no {vendor} device visible to torch') if n == 0 or hip != {vendor == 'rocm'} else print(n)"
    )
    count = session.run("python3", "-c", probe, silent=True, external=True).strip().splitlines()[-1]
    env = {"TILE_KERNELS_TEST_DEVICE": "gpu", "TRITON_INTERPRET": "0", "TILE_KERNELS_NUM_GPUS": count,
           "TILE_KERNELS_GPU_VENDOR": vendor}  # fmt: skip
    if vendor == "rocm":
        env["HIP_VISIBLE_DEVICES"] = os.environ.get("HIP_VISIBLE_DEVICES", ",".join(map(str, range(int(count)))))
    return env


def _gpu_tests(session, vendor: str):
    env = _gpu_setup(session, vendor)
    # TILE_KERNELS_WORKERS_PER_GPU pytest-xdist workers a GPU (default 8; conftest pins worker K to GPU K mod the
    # count), at most one a CPU core: the tests spend most of their time compiling on the host (one H100: the suite's
    # first 93% took 480 s on 8 workers; 14 workers shared its memory without a failure). loadgroup keeps
    # multi-process tests on one worker
    per_gpu = int(os.environ.get("TILE_KERNELS_WORKERS_PER_GPU", "8"))
    count = max(1, min(int(env["TILE_KERNELS_NUM_GPUS"]) * per_gpu, os.cpu_count() or 1))
    workers = ["-n", str(count), "--dist", "loadgroup"]
    profile = os.environ.get("HYPOTHESIS_PROFILE", "gpu")  # ci: fewer examples, for a time-boxed machine
    session.run("python3", "-m", "pytest", *workers, *session.posargs, env={**env, "HYPOTHESIS_PROFILE": profile})


@nox.session(name="gpu_tests-cuda", venv_params=["--system-site-packages"])
def gpu_tests_cuda(session):
    """GPU suite on an NVIDIA device: compiled kernels, torch + jax-triton, opcheck, torch.compile."""
    _gpu_tests(session, "cuda")


@nox.session(name="gpu_tests-rocm", venv_params=["--system-site-packages"])
def gpu_tests_rocm(session):
    """GPU suite on an AMD device: the same checks on ROCm, one pytest-xdist worker per GPU."""
    _gpu_tests(session, "rocm")


@nox.session(name="sanitize-cuda", venv_params=["--system-site-packages"])
def sanitize_cuda(session):
    """The op suite under compute-sanitizer memcheck and racecheck; any report fails.

    dev Hypothesis profile; torch's and XLA's pooling allocators off so that out-of-bounds accesses hit unallocated
    memory. racecheck runs the torch half (the JAX half launches the same compiled kernels), less
    fused_linear_cross_entropy: cuBLAS's split-K GEMM kernels (nvjet_*_splitK) that it calls report hazards under
    racecheck (H200, 2026-11-29); its own cross-entropy kernel runs in the cross_entropy tests."""
    env = {**_gpu_setup(session, "cuda"), "HYPOTHESIS_PROFILE": "dev", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
           "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}  # fmt: skip
    pytest = ["python3", "-m", "pytest", "-p", "no:xdist", "-x", *session.posargs]
    sanitizer = ["compute-sanitizer", "--error-exitcode", "1", "--target-processes", "all"]
    session.run(*sanitizer, "--tool", "memcheck", *pytest, "tests/test_ops.py", env=env, external=True)
    racecheck = [*sanitizer, "--tool", "racecheck", *pytest, "tests/test_ops.py", "-k", "torch and not fused_linear"]
    session.run(*racecheck, env=env, external=True)


@nox.session(venv_params=["--system-site-packages"])
def bench(session):
    """`tile-kernels bench` on this machine's GPU (TILE_KERNELS_GPU_VENDOR=rocm for AMD), with the peers it finds
    (Liger-Kernel installed if missing) and matplotlib for the plots. Arguments go to the command, e.g.
    `nox -s bench -- --op rms_norm --out benchmarks/results/h200`."""
    env = _gpu_setup(session, os.environ.get("TILE_KERNELS_GPU_VENDOR", "cuda"))
    for module, dist in (("matplotlib", "matplotlib"), ("liger_kernel", "liger-kernel")):
        if not _has(session, module):
            session.install(dist)
    session.run("python3", "-m", "tile_kernels.cli", "bench", *session.posargs, env=env)


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


@nox.session(name="aot-oldest-triton")
def aot_oldest_triton(session):
    """The Triton kernels compiled by the oldest Triton the package allows (the `tests` session runs it after itself:
    the CPU suite compiles with the newest). Without arguments: 2 configurations of every kernel (its first and last)
    for all six targets, ~2 min on 2 cores; `-- --target cuda:90` (no --per-kernel) compiles a target's whole
    matrix."""
    session.install(OLDEST_TRITON, "numpy")
    session.install("--no-deps", "-e", ".")
    args = session.posargs or ["--per-kernel", "2"]
    session.run("tile-kernels", "aot", "--quiet", *args, env={"TRITON_INTERPRET": "0"})


@nox.session
def lint(session):
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")

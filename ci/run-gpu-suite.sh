#!/usr/bin/env bash
# The GPU suite straight from a checkout, for a GPU machine with torch / jax / triton already installed and no
# package index to reach (what `nox -s gpu_tests-cuda` runs after its installs). Extra arguments go to pytest.
#   ci/run-gpu-suite.sh -n 8
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/packages/core/src:$PWD/packages/torch_ops/src:$PWD/packages/jax_ops/src${PYTHONPATH:+:$PYTHONPATH}"
export TILE_KERNELS_TEST_DEVICE=gpu HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch and JAX share the device in one process
exec python3 -m pytest tests -rs "$@"

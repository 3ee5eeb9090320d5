set -e
mkdir -p /tmp/site && [ -e /tmp/site/.done ] || { tar -xJf .gpu/site-py312.tar.xz -C /tmp/site && touch /tmp/site/.done; }
export PYTHONPATH=/tmp/site:$PWD/packages/core/src:$PWD/packages/torch_ops/src:$PWD/packages/jax_ops/src:$PWD/packages/megakernel/src PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
tk() { python -c "import sys; from tile_kernels.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
set +e

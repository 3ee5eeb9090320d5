. .gpu/setup.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; nproc; lscpu | grep -E 'Model name|MHz' ; python -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 240 python benchmarks/eager_profile.py --out /tmp/prof 2>&1 | tee $OUT/eager_profile.txt | tail -150
TILE_KERNELS_TEST_DEVICE=gpu HYPOTHESIS_PROFILE=ci timeout 300 python -m pytest -x -q -p no:cacheprovider tests/test_decode_attention.py 2>&1 | tail -40 | tee $OUT/pytest_decode.txt

. .gpu/setup.sh
timeout 60 python benchmarks/eager_profile.py --wake 2>&1 | tee $OUT/wake.txt
timeout 150 python benchmarks/jax_profile.py 2>&1 | tail -30 | tee $OUT/jax_profile.txt
timeout 360 python benchmarks/train_step.py --shape llama-1b --mode compile --variant stock --variant tile-kernels --variant liger --out $OUT/train 2>&1 | tail -30

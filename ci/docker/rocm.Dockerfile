# GPU-suite image for a self-hosted AMD runner (MI300, gfx942), on a ROCm PyTorch base image (torch present, so the
# session installs none). Build: docker build -f ci/docker/rocm.Dockerfile .
# Run with the devices and groups a ROCm container needs:
#   docker run --rm --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host \
#     --security-opt seccomp=unconfined IMAGE
FROM rocm/pytorch:latest
RUN python3 -m pip install nox
WORKDIR /src
COPY . /src
CMD ["python3", "-m", "nox", "-s", "gpu_tests-rocm"]

# GPU-suite image for a self-hosted NVIDIA runner (H100/H200). Build: docker build -f ci/docker/cuda.Dockerfile .
# Run: docker run --gpus all --rm IMAGE   (the suite runs from the mounted or copied checkout)
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m pip install --break-system-packages nox
WORKDIR /src
COPY . /src
CMD ["python3", "-m", "nox", "-s", "gpu_tests-cuda", "sanitize-cuda"]

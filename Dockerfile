# megatron-rl on NVIDIA's PyTorch container. CUDA, cuDNN, NCCL, torch, Transformer Engine and apex
# come from the image; megatron-core and this package are installed against the image's own
# versions (nothing it ships is rebuilt or replaced). The image's Python is 3.12.
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/megatron-rl:TAG --push .
#   enroot import -o megatron-rl.sqsh docker://REGISTRY#megatron-rl:TAG     # for pyxis (slurm/)
#
# GB200 nodes are aarch64: build both platforms (the base image is published for both).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron-rl

# bubblewrap: the sandbox that runs a code tool's programs (megatron_rl/environments/sandbox.py), at
# the version of the image's own Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# Every package the image ships, pinned at its installed version: pip may add packages, never
# change these (torch, transformer-engine, apex, flash-attn, nccl ...).
RUN pip list --format=freeze > /opt/image-constraints.txt

COPY . .
# The gpu extra pins what megatron-core 0.16.1 supports (transformer-engine>=2.9,<2.12): if the
# image's Transformer Engine is outside that, this step fails rather than replacing it.
RUN pip install --no-cache-dir --constraint /opt/image-constraints.txt --editable ".[gpu]" \
    && python -c "import megatron.core, megatron_rl, transformer_engine; print('megatron-core', megatron.core.__version__)"

ENV PYTHONUNBUFFERED=1
CMD ["python", "train.py", "--list-recipes"]

# rlstream image: the `rlstream` CLI with a CPU (default) or CUDA build of torch.
#
#   docker build -t rlstream .                                  # CPU torch (the CPU demo)
#   docker build -t rlstream:cu124 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
#
# docker-compose.yml builds it for the redis/etcd/engine/producer/trainer/inspect services.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small; a CUDA index gives a GPU trainer.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OMP_NUM_THREADS=1

RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends redis-tools curl \
 && rm -rf /var/lib/apt/lists/*

# torch first and pinned (a bare `torch` from PyPI pulls the multi-GB CUDA build).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/rlstream
# The whole checkout (pyproject names README.md); .dockerignore keeps runs, venvs and .git out.
COPY . .
RUN pip install ".[etcd,math]"

# Runs, checkpoints and shared weights live on a volume mounted here.
WORKDIR /work
ENTRYPOINT ["rlstream"]
CMD ["--help"]

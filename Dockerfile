# Dressage services image. One image, every service: the container command picks it
# (`dressage engine --config ...`, `dressage trainer ...`, ...); see docker-compose.yml.
#
#   docker build -t dressage:cpu .                                  # CPU (default target)
#   docker build -t dressage:gpu --target gpu .                     # CUDA trainer (SGLang base image)
#   docker build -t dressage:gpu --target gpu --build-arg SGLANG_IMAGE=lmsysorg/sglang:<tag> .

ARG PYTHON_IMAGE=python:3.11-slim
ARG SGLANG_IMAGE=lmsysorg/sglang:latest

# --- GPU image: the project on top of an SGLang image (CUDA torch already inside) ------------
FROM ${SGLANG_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# The base image's CUDA torch satisfies the torch requirement, so pip keeps it. CUDA needs no root:
# the trainer runs as uid 10001 like the CPU image (the SGLang engine image itself stays upstream's).
RUN pip install . && useradd --create-home --uid 10001 dressage \
    && mkdir -p /checkpoints /app/models /app/runs && chown dressage /checkpoints /app/models /app/runs
COPY configs ./configs
COPY data ./data
USER dressage
ENTRYPOINT ["dressage"]
CMD ["--help"]

# --- CPU image, the default target (last stage) ---------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app
# The CPU build of torch first: a bare `pip install torch` would pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . && useradd --create-home --uid 10001 dressage \
    && mkdir -p /checkpoints /app/models /app/runs && chown dressage /checkpoints /app/models /app/runs
COPY configs ./configs
COPY data ./data
USER dressage
ENTRYPOINT ["dressage"]
CMD ["--help"]

# Dressage services image. One image, every service: the container command picks it
# (`dressage engine --config ...`, `dressage trainer ...`, ...); see docker-compose.yml.
#
#   docker build -t dressage:cpu --target cpu .                     # CPU
#   docker build -t dressage:gpu --target gpu .                     # CUDA trainer (SGLang base image)
#   docker build -t dressage:gpu --target gpu --build-arg SGLANG_IMAGE=lmsysorg/sglang:<tag> .
#
# Without Docker Hub (docs/operations.md "Images without Docker Hub"): `make images` builds Debian
# base images locally (scripts/local-base-images.sh) and passes them as PYTHON_IMAGE / REDIS_IMAGE;
# pip then needs the host's network (`docker build --network host`, `build.network` in compose).
# Name the target: the classic builder (what Compose uses without buildx) builds every stage before
# it, so the CPU stages come first and never need the SGLang image.

ARG PYTHON_IMAGE=python:3.11-slim
# The one SGLang pin: engine-sglang runs it and trainer-gpu builds on it (docker-compose.yml passes
# the same SGLANG_IMAGE to both), so trainer and engines share one torch / transformers.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

# --- CPU torch in a venv, a stage of its own so that a local wheel never lands in the image ----
FROM ${PYTHON_IMAGE} AS cpu-torch
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# docker/wheels/ holds torch's CPU wheel when `make images` found one in pip's find-links; else the
# wheel comes from PyTorch's CPU index. `==X+cpu` matches no CUDA build, and the check after says so.
COPY docker/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
    && if ls /tmp/wheels/torch-${TORCH_VERSION}+cpu-*.whl >/dev/null 2>&1; then src="--find-links /tmp/wheels"; \
       else src="--extra-index-url https://download.pytorch.org/whl/cpu"; fi \
    && /opt/venv/bin/pip install $src "torch==${TORCH_VERSION}+cpu" \
    && /opt/venv/bin/python -c "import sys, torch; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else 'not a CPU torch: ' + v)"

# --- CPU image ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /app
COPY --from=cpu-torch /opt/venv /opt/venv
# The dependencies (pyproject.toml's list) in a layer of their own, so a change to the code rebuilds
# in seconds; torch is already there and satisfies its range.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && useradd --create-home --uid 10001 dressage \
    && mkdir -p /checkpoints /app/models /app/runs && chown dressage /checkpoints /app/models /app/runs
COPY shared ./shared
COPY services ./services
COPY tools ./tools
RUN pip install --no-deps .
COPY configs ./configs
COPY data ./data
USER dressage
ENTRYPOINT ["dressage"]
CMD ["--help"]

# --- GPU image: the project on top of an SGLang image (CUDA torch already inside) ------------
FROM ${SGLANG_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY tools ./tools
# The base image's CUDA torch and transformers satisfy pyproject's ranges (they admit what SGLang
# 0.5.9-0.5.23 ship), so pip keeps them. CUDA needs no root: the trainer runs as uid 10001 like the
# CPU image (the SGLang engine image itself stays upstream's).
RUN pip install . && useradd --create-home --uid 10001 dressage \
    && mkdir -p /checkpoints /app/models /app/runs && chown dressage /checkpoints /app/models /app/runs
COPY configs ./configs
COPY data ./data
USER dressage
ENTRYPOINT ["dressage"]
CMD ["--help"]

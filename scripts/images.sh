#!/usr/bin/env bash
# `make images`: the base images (pulled, or built from Debian's packages without Docker Hub), then
# the project's CPU image `dressage:cpu` on them, with the CPU build of torch.
#
#   scripts/images.sh [ENV_FILE]      # ENV_FILE (e.g. images.env) gets PYTHON_IMAGE, REDIS_IMAGE and
#                                     # DOCKER_BUILD_NETWORK for compose: COMPOSE_ENV_FILES=.env,secrets.env,images.env
#
# torch: a `torch-<the Dockerfile's TORCH_VERSION>+cpu` wheel for Python 3.11 found in pip's find-links directories is
# copied to docker/wheels/ (the build then needs no PyTorch index); else the build takes it from
# PyTorch's CPU index. Either way it is the `+cpu` build or the build fails (Dockerfile, stage cpu-torch).
# pip inside the build uses the host's network when the engine has no default bridge network (an
# engine started by scripts/docker-engine.sh has none); otherwise Docker's default.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=$(sed -n "s/^ARG TORCH_VERSION=//p" Dockerfile)  # the Dockerfile's pin, the one source
env_file=${1:-}

exports=$(scripts/local-base-images.sh)
eval "$exports"
if docker network inspect bridge >/dev/null 2>&1; then network=default; else network=host; fi

find_links=${PIP_FIND_LINKS:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.find-links='\(.*\)'$/\1/p" | head -1)}
for dir in $find_links; do
  for wheel in "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl; do
    [ -f "$wheel" ] || continue
    [ -f "docker/wheels/$(basename "$wheel")" ] || cp "$wheel" docker/wheels/
    echo "images: torch from $wheel" >&2
  done
done

lines="PYTHON_IMAGE=$PYTHON_IMAGE
REDIS_IMAGE=$REDIS_IMAGE
DOCKER_BUILD_NETWORK=$network"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
images_env=${env_file:-$work/images.env}
printf '# Written by scripts/images.sh (make images), for docker compose: COMPOSE_ENV_FILES=.env,secrets.env,%s\n%s\n' \
  "${env_file:-images.env}" "$lines" >"$images_env"

# Built by Compose itself, so that `docker compose up --build` finds every layer in the same builder's
# cache. Compose interpolates the whole file, secrets included, even to build: placeholders serve (no
# secret goes into an image).
if docker compose version >/dev/null 2>&1; then compose=(docker compose); \
elif command -v docker-compose >/dev/null 2>&1; then compose=(docker-compose); else compose=(.venv/bin/docker-compose); fi
scripts/compose-secrets.sh "$work/placeholders.env" 2>/dev/null
echo "images: building ${DRESSAGE_IMAGE:-dressage:cpu} on $PYTHON_IMAGE (build network: $network)" >&2
"${compose[@]}" --env-file .env --env-file "$images_env" --env-file "$work/placeholders.env" \
  build --quiet >&2
[ -n "$env_file" ] && echo "images: wrote $env_file" >&2
sed 's/^/export /' <<<"$lines"

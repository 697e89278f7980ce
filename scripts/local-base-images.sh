#!/usr/bin/env bash
# Base images for the project image and Redis, built from Debian's packages when Docker Hub cannot
# be reached (and pulled as usual when it can).
#
#   scripts/local-base-images.sh          # prints the two lines to export, e.g.
#                                         #   export PYTHON_IMAGE=dressage-base/python:3.11-bookworm
#                                         #   export REDIS_IMAGE=dressage-base/redis:7-bookworm
#   scripts/local-base-images.sh --local  # skip the pull attempt; build from Debian's packages
#
# For each of $PYTHON_IMAGE (default python:3.11-slim) and $REDIS_IMAGE (default redis:7.2-alpine):
# present locally -> kept; else pulled; if the pull fails, a Debian bookworm root filesystem is made
# with debootstrap (installed with apt-get when missing; root only) and imported with `docker import`:
#   * Python: python3 (3.11), python3-venv, pip and CA certificates. The machine's CA bundle (pip's
#     `cert`, else /etc/ssl/certs/ca-certificates.crt) replaces Debian's, so that pip inside a build
#     trusts what pip on this machine trusts (an intercepting proxy's CA, for one).
#   * Redis: Debian's redis-server 7.0 (ACL selectors need >= 7.0) and redis-cli, run as user `redis`
#     in /data (a fresh named volume takes the image's /data and its owner), as redis:7.2-alpine does.
# Building each takes about a minute; a tag that already exists is reused (`--rebuild` remakes it).
set -euo pipefail

PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim}
REDIS_IMAGE=${REDIS_IMAGE:-redis:7.2-alpine}
LOCAL_PYTHON=dressage-base/python:3.11-bookworm
LOCAL_REDIS=dressage-base/redis:7-bookworm
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PULL_TIMEOUT_S=${PULL_TIMEOUT_S:-60}
local_only=0 rebuild=0
for arg in "$@"; do
  case $arg in
    --local) local_only=1 ;;
    --rebuild) rebuild=1; local_only=1 ;;
    *) echo "usage: $0 [--local] [--rebuild]" >&2; exit 2 ;;
  esac
done

have() { docker image inspect "$1" >/dev/null 2>&1; }
say() { echo "base images: $*" >&2; }

# debootstrap DIR PACKAGES: a minimal bookworm with PACKAGES, apt's caches emptied.
bootstrap() {
  local dir=$1 packages=$2
  command -v debootstrap >/dev/null 2>&1 || {
    [ "$(id -u)" = 0 ] || { say "debootstrap is missing and installing it needs root"; exit 1; }
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } >&2
  }
  [ "$(id -u)" = 0 ] || { say "debootstrap needs root"; exit 1; }
  mkdir -p "$CACHE"
  debootstrap --variant=minbase --cache-dir="$CACHE" --include="$packages" "$SUITE" "$dir" "$MIRROR" >"$dir.log" 2>&1 \
    || { say "debootstrap failed; last lines of $dir.log:"; tail -5 "$dir.log" >&2; exit 1; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/*
}

build_python() {
  local dir=$WORK/python cert
  say "building $LOCAL_PYTHON from Debian's packages (debootstrap, about a minute)"
  bootstrap "$dir" python3,python3-venv,python3-pip,ca-certificates
  cert=${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -1)}
  cert=${cert:-/etc/ssl/certs/ca-certificates.crt}
  [ -f "$cert" ] && cp "$cert" "$dir/etc/ssl/certs/ca-certificates.crt"
  tar -C "$dir" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$LOCAL_PYTHON" >/dev/null
}

build_redis() {
  local dir=$WORK/redis
  say "building $LOCAL_REDIS from Debian's packages (debootstrap, about a minute)"
  bootstrap "$dir" redis-server
  mkdir -p "$dir/data" && chroot "$dir" chown redis:redis /data
  tar -C "$dir" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'WORKDIR /data' --change 'USER redis' --change 'EXPOSE 6379' \
    --change 'CMD ["redis-server"]' - "$LOCAL_REDIS" >/dev/null
}

# pick WANTED LOCAL BUILDER: prints the image to use.
pick() {
  local wanted=$1 local_tag=$2 builder=$3
  if [ "$local_only" = 0 ]; then
    have "$wanted" && { echo "$wanted"; return; }
    if timeout "$PULL_TIMEOUT_S" docker pull -q "$wanted" >/dev/null 2>&1; then echo "$wanted"; return; fi
    say "cannot pull $wanted (Docker Hub unreachable?): using $local_tag"
  fi
  if [ "$rebuild" = 1 ] || ! have "$local_tag"; then "$builder"; fi
  echo "$local_tag"
}

docker info >/dev/null 2>&1 || { say "no Docker engine answers (scripts/docker-engine.sh starts one)"; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dressage-base.XXXXXX")
CACHE=${DEBOOTSTRAP_CACHE:-/var/cache/dressage-debootstrap}
trap 'rm -rf "$WORK"' EXIT
python_image=$(pick "$PYTHON_IMAGE" "$LOCAL_PYTHON" build_python)
redis_image=$(pick "$REDIS_IMAGE" "$LOCAL_REDIS" build_redis)
echo "export PYTHON_IMAGE=$python_image"
echo "export REDIS_IMAGE=$redis_image"

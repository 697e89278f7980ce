#!/usr/bin/env bash
# Make sure a Docker engine answers, starting one when none runs and this machine allows it.
#
#   scripts/docker-engine.sh            # exit 0: `docker info` works (an engine was running, or is now)
#                                       # exit 77: no engine can run here; one line on stderr says why
#                                       # exit 1: an engine should run here but did not start (see the log)
#
# Starting one needs root, cgroups and Debian's packages (`docker.io`, installed with apt-get when
# missing). The engine is started the way that works on machines without iptables:
#   dockerd --iptables=false --bridge=none [--storage-driver=vfs]
# (containers get no default bridge; Compose makes its own networks, which work). dockerd picks its
# storage driver (overlay2 where the kernel has overlayfs); if it does not start, it is started again
# with vfs, which works everywhere but copies the whole image for every container (an `up` of the
# stack then takes minutes). DOCKERD_STORAGE_DRIVER forces one. Its log goes to $DOCKERD_LOG; the pid
# of an engine started here is written to $DOCKERD_PIDFILE, so whoever started it can stop it
# (`kill "$(cat "$DOCKERD_PIDFILE")"`) and nobody stops an engine they did not start.
# An engine stopped while Compose was removing its networks can leave a network store that makes the
# next dockerd panic at start (libnetwork reservePools); that store is moved aside (to
# local-kv.db.broken-<time>; images, containers and volumes are untouched) and dockerd started again.
# Only a fatal or error line about cgroups or permissions means "cannot run here" (77); a panic or a
# timeout is a failure (1), never a skip.
set -euo pipefail

CANNOT=77                                              # automake's "skipped": distinct from a failure
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dressage-dockerd.log}
DOCKERD_PIDFILE=${DOCKERD_PIDFILE:-/run/dressage-dockerd.pid}

cannot() { echo "docker engine: cannot run here: $*" >&2; exit "$CANNOT"; }

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  exit 0                                               # one is running (ours or the machine's)
fi
[ "$(id -u)" = 0 ] || cannot "no engine is running and starting one needs root (uid $(id -u))"
[ -d /sys/fs/cgroup ] && [ -n "$(ls -A /sys/fs/cgroup 2>/dev/null)" ] || cannot "no cgroups (/sys/fs/cgroup is empty)"
if ! command -v dockerd >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || cannot "dockerd is not installed and there is no apt-get to install docker.io"
  echo "docker engine: installing docker.io from Debian's packages" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io; } >"$DOCKERD_LOG.apt" 2>&1 \
    || cannot "apt-get install docker.io failed (log: $DOCKERD_LOG.apt)"
fi
# start [DRIVER]: dockerd in the background; 0 once `docker info` answers (60 s at most).
start() {
  local driver=(${1:+--storage-driver=$1})
  echo "docker engine: starting dockerd (storage ${1:-chosen by dockerd}, log $DOCKERD_LOG)" >&2
  setsid dockerd "${driver[@]}" --iptables=false --bridge=none >"$DOCKERD_LOG" 2>&1 </dev/null &
  echo $! >"$DOCKERD_PIDFILE"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$(cat "$DOCKERD_PIDFILE")" 2>/dev/null || return 1
    sleep 1
  done
  kill "$(cat "$DOCKERD_PIDFILE")" 2>/dev/null; sleep 5
  return 1
}

NETWORK_STORE=${DOCKERD_NETWORK_STORE:-/var/lib/docker/network/files/local-kv.db}
start "${DOCKERD_STORAGE_DRIVER:-}" && exit 0
if grep -q "libnetwork.*reservePools" "$DOCKERD_LOG" && [ -f "$NETWORK_STORE" ]; then
  moved="$NETWORK_STORE.broken-$(date +%Y%m%dT%H%M%S)"
  echo "docker engine: dockerd panicked restoring its networks; moving $NETWORK_STORE to $moved" >&2
  mv "$NETWORK_STORE" "$moved"
  start "${DOCKERD_STORAGE_DRIVER:-}" && exit 0
fi
if [ -z "${DOCKERD_STORAGE_DRIVER:-}" ]; then
  cp "$DOCKERD_LOG" "$DOCKERD_LOG.first"
  start vfs && exit 0
fi
FATAL='level=(fatal|error).*(cgroup|operation not permitted|permission denied)'
if ! grep -q "^panic:" "$DOCKERD_LOG" && grep -qiE "$FATAL" "$DOCKERD_LOG"; then
  cannot "dockerd did not start: $(grep -iE "$FATAL" "$DOCKERD_LOG" | tail -1)"
fi
echo "docker engine: dockerd did not start or answer within 60 s; last lines of $DOCKERD_LOG:" >&2
tail -5 "$DOCKERD_LOG" >&2
exit 1

#!/usr/bin/env bash
# `make compose-test`: the compose tier (tests/compose), its short preset (the collector trimming, as
# users run it) then its full one (tests/compose/conftest.py), or only the preset DRESSAGE_COMPOSE_TIER names.
#
# Exit 0: every check passed; 1: a check failed (pytest's summary and the tier's one line say which);
# 77: no Docker engine can run on this machine (no root, no cgroups), said in one line; nothing ran.
# A Docker engine is started when none runs (scripts/docker-engine.sh) and stopped again at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

docker info >/dev/null 2>&1 && running=1 || running=0
scripts/docker-engine.sh
rc=$?
if [ "$rc" != 0 ]; then
  [ "$rc" = 77 ] && echo "compose tier: not run: no Docker engine can run here (see the line above)" >&2
  exit "$rc"
fi
rc=0
for tier in ${DRESSAGE_COMPOSE_TIER:-short full}; do
  DRESSAGE_COMPOSE_TIER=$tier .venv/bin/python -m pytest -q -p no:cacheprovider tests/compose || rc=1
done
pidfile=${DOCKERD_PIDFILE:-/run/dressage-dockerd.pid}
if [ "$running" = 0 ] && [ "${DRESSAGE_COMPOSE_KEEP_ENGINE:-0}" != 1 ] && [ -f "$pidfile" ]; then
  kill "$(cat "$pidfile")" 2>/dev/null
fi
[ "$rc" = 0 ] || exit 1

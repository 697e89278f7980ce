#!/bin/bash
# profile every service of one async run for 15 s, 25 s after its trainer starts
cd "$(git rev-parse --show-toplevel)"
out=${1:-/tmp/profile}; mkdir -p $out
.venv/bin/dressage experiment docs/results/async-vs-sync-chain-20261204/spec-profile.yaml --variants async-eta1-live-bc --out $out/exp --quiet > $out/exp.log 2>&1 &
while ! pgrep -f "services trainer" >/dev/null; do sleep 1; done
sleep 25
for svc in engine proxy trainer group-collector prompt-buffer; do
  pid=$(pgrep -f "services $svc " | head -1)
  .venv/bin/py-spy record --pid $pid --duration 15 --rate 40 --nonblocking --format raw -o $out/$svc.txt > $out/$svc.log 2>&1 &
done
pid=$(pgrep -f "services rollout-worker " | head -1)
.venv/bin/py-spy record --pid $pid --duration 15 --rate 40 --nonblocking --format raw -o $out/worker.txt > $out/worker.log 2>&1 &
wait

#!/bin/bash
# pin the trainer to cpu0 and the rollout side to cpu1 while runs come and go
while true; do
  for pid in $(pgrep -f "services trainer "); do taskset -p 1 $pid >/dev/null 2>&1; taskset -a -p 1 $pid >/dev/null 2>&1; done
  for pid in $(pgrep -f "services (engine|proxy|rollout-worker|group-collector|prompt-buffer) "); do taskset -a -p 2 $pid >/dev/null 2>&1; done
  for pid in $(pgrep -f "redis-server 127.0.0.1:[0-9]" | grep -v "^$(pgrep -f 'redis-server 127.0.0.1:6379$')$"); do taskset -a -p 2 $pid >/dev/null 2>&1; done
  sleep 0.3
done

#!/usr/bin/env bash
# A one-machine Ray cluster for tests/ray_cluster/: a head with 4 logical CPUs and no GPU, its job API (the dashboard) on
# 127.0.0.1:8265, the address the tests use unless HP_TOOL_RAY_ADDRESS says otherwise.
#   bash tests/ray_cluster/head.sh start | stop | status
set -euo pipefail
export RAY_USAGE_STATS_ENABLED=0
case "${1:-status}" in
  start)
    if ray status >/dev/null 2>&1; then echo "a Ray head is already running"; exit 0; fi
    ray start --head --num-cpus=4 --num-gpus=0 --dashboard-host=127.0.0.1 --dashboard-port=8265 \
      --disable-usage-stats --temp-dir=/tmp/hp_tool_ray >/dev/null
    for _ in $(seq 60); do  # the job API answers a little after the head
      if python3 -c "from ray.job_submission import JobSubmissionClient as C; C('http://127.0.0.1:8265').list_jobs()" \
           >/dev/null 2>&1; then echo "Ray head up: job API at http://127.0.0.1:8265"; exit 0; fi
      sleep 1
    done
    echo "the Ray head started but its job API did not answer in 60 s" >&2; exit 1 ;;
  stop) ray stop --force >/dev/null 2>&1 || true; echo "Ray head stopped" ;;
  status) ray status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

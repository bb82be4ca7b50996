#!/usr/bin/env bash
# Start a Ray head on this workstation for moestream: loopback binds, token auth, dashboard
# (Jobs API) on 127.0.0.1:8265, explicit object store. No SSH needed (cf. cluster.yaml).
#   bash deploy/start-head.sh                 # then: moestream serve store/ --address auto
#   OBJECT_STORE_BYTES=16000000000 NUM_GPUS=1 bash deploy/start-head.sh
# Stop it with `ray stop` (that stops every Ray process on this host).
set -euo pipefail
cd "$(dirname "$0")/.."
set -a
. deploy/ray.env
set +a
args=(--head --port="${RAY_PORT:-6379}" --node-ip-address=127.0.0.1
      --dashboard-host=127.0.0.1 --dashboard-port="${DASHBOARD_PORT:-8265}"
      --ray-client-server-port="${CLIENT_PORT:-10001}"
      --object-store-memory="${OBJECT_STORE_BYTES:-8000000000}"
      --resources='{"loader_slot": 4, "nvme": 1}')
[ -n "${NUM_CPUS:-}" ] && args+=(--num-cpus="$NUM_CPUS")
[ -n "${NUM_GPUS:-}" ] && args+=(--num-gpus="$NUM_GPUS")
exec ray start "${args[@]}" "$@"

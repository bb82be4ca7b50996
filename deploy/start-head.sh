#!/usr/bin/env bash
# Start a Ray head on this workstation for moestream: every socket on 127.0.0.1 (single-node
# mode, deploy/ray.env), token auth, dashboard (Jobs API) on 127.0.0.1:8265, a per-account
# temp dir, explicit object store. No SSH needed (cf. cluster.yaml, which runs this script).
#   bash deploy/start-head.sh                 # then: moestream serve store/ --address auto
#   OBJECT_STORE_BYTES=16000000000 NUM_GPUS=1 bash deploy/start-head.sh
# Stop it with `bash deploy/stop-head.sh` (this cluster only; `ray stop` stops every Ray
# cluster of the account).
set -euo pipefail
cd "$(dirname "$0")/.."
set -a
. deploy/ray.env
set +a
[ -x .venv/bin/ray ] && PATH="$PWD/.venv/bin:$PATH"
mkdir -p -m 700 "$RAY_TMPDIR"
[ -O "$RAY_TMPDIR" ] || { echo "$RAY_TMPDIR belongs to another account; set RAY_TMPDIR" >&2; exit 1; }
[ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ] || [ -n "${RAY_AUTH_TOKEN:-}" ] ||
    { echo "no Ray auth token: run deploy/setup.sh (or: ray get-auth-token --generate)" >&2; exit 1; }
args=(--head --port="${RAY_PORT:-6379}" --node-ip-address=127.0.0.1
      --dashboard-host=127.0.0.1 --dashboard-port="${DASHBOARD_PORT:-8265}"
      --ray-client-server-port="${CLIENT_PORT:-10001}"
      --object-store-memory="${OBJECT_STORE_BYTES:-2000000000}"
      --resources='{"loader_slot": 4, "nvme": 1}')
[ -n "${NUM_CPUS:-}" ] && args+=(--num-cpus="$NUM_CPUS")
[ -n "${NUM_GPUS:-}" ] && args+=(--num-gpus="$NUM_GPUS")
exec ray start "${args[@]}" "$@"

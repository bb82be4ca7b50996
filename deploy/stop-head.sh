#!/usr/bin/env bash
# Stop the Ray cluster deploy/start-head.sh started, and only it (`ray stop` would stop every
# Ray cluster of this account). The loaders' shared memory goes with their processes.
#   bash deploy/stop-head.sh
set -euo pipefail
cd "$(dirname "$0")/.."
set -a
. deploy/ray.env
set +a
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" deploy/stop_cluster.py --temp-dir "$RAY_TMPDIR/ray" --port "${RAY_PORT:-6379}" "$@"

#!/usr/bin/env bash
# The demo setup swept: two simulated Llama-3.1-8B H100 engines behind the gateway
# (policies/demo.yaml), the demo workload (loadtests/workloads/demo.yaml), time scale K.
# Usage: loadtests/proofs/demo_sweep.sh [OUT_DIR] [RATES] [DURATION_S] [K]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-loadtests/results/demo-sweep}
RATES=${2:-4,8,16,24,32,40,48}
DURATION=${3:-40}
K=${4:-8}
PORT=18080
if curl -s -o /dev/null http://127.0.0.1:$PORT/ 2>/dev/null; then
  echo "port $PORT is already in use: stop whatever listens there first" >&2
  exit 1
fi
.venv/bin/inference-gateway demo --port $PORT --time-scale "$K" > /tmp/demo-sweep-gateway.log 2>&1 &
DEMO=$!
trap 'kill $DEMO 2>/dev/null; wait $DEMO 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:$PORT/readyz >/dev/null && break; sleep 0.1; done
kill -0 $DEMO  # the demo must be the process answering
rm -rf "$OUT"
.venv/bin/inference-gateway loadtest sweep --workload loadtests/workloads/demo.yaml \
  --target http://127.0.0.1:$PORT --rates "$RATES" --duration "$DURATION" --time-scale "$K" \
  --out "$OUT" --quiet
.venv/bin/inference-gateway loadtest report "$OUT" --out "$OUT/report.md"

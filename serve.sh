#!/usr/bin/env bash
# Serve the packed draft model over HTTP: POST /draft, GET /health, GET /metrics, GET /openapi.json.
#
#   ./serve.sh                                   # ./model (packed dir) on http://127.0.0.1:8000
#   MODEL_DIR=runs/demo/packed PORT=0 ./serve.sh # port 0: the log line "listening on http://..." names it
#   ./serve.sh --compute bfloat16 --threads 2    # any other `specdraft serve` option is passed through
#
# MODEL_DIR defaults to ./model and WEIGHTS to $MODEL_DIR/draft.qd4 (so ./model/draft.qd4); set WEIGHTS=
# (empty) to let the server decide (draft.qd4 when present, else from_pretrained on MODEL_DIR).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL_DIR="${MODEL_DIR:-./model}"
WEIGHTS="${WEIGHTS-$MODEL_DIR/draft.qd4}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi
args=(serve --model-dir "$MODEL_DIR" --host "$HOST" --port "$PORT")
if [[ -n "$WEIGHTS" ]]; then args+=(--weights "$WEIGHTS"); fi
exec "$PYTHON" -m specdraft.cli "${args[@]}" "$@"

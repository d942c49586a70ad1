#!/usr/bin/env bash
# The GPU smoke run: the GPU-marked tests and the reference rehearsal (`specdraft rehearse --device cuda`) end to
# end on a CUDA machine, then a pass/fail table. Nothing else depends on it; CI never runs it.
#
#   bench/gpu_smoke.sh [OUT_DIR]        # default runs/gpu_smoke; timeouts of 150 s (tests) and 420 s (rehearsal): under 10 minutes
#
# It uses the Python in $PYTHON (default: .venv/bin/python when present, else python3), which must have a CUDA
# build of torch; specdraft is installed into it (editable, with the dev and llama extras' Python parts) when it
# is missing. The rehearsal needs ../shared/models/qwen3-tokenizer beside the checkout, or QWEN3_TOKENIZER=DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_smoke}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TOKENIZER=${QWEN3_TOKENIZER:-../shared/models/qwen3-tokenizer/tokenizer}
mkdir -p "$OUT"
declare -a ROWS

row() { ROWS+=("| $1 | $2 | $3 |"); }

if ! "$PYTHON" -c "import specdraft" 2>/dev/null; then
  "$PYTHON" -m pip install -q -e '.[dev]' >"$OUT/install.log" 2>&1 || { echo "install failed: $OUT/install.log"; exit 2; }
fi

cuda=$("$PYTHON" -c "import torch; print(torch.cuda.is_available() and torch.cuda.get_device_name(0) or '')" 2>/dev/null)
torch_version=$("$PYTHON" -c "import torch; print(torch.__version__, torch.version.cuda)" 2>/dev/null)
if [ -n "$cuda" ]; then row "CUDA" PASS "$cuda, torch $torch_version"; else row "CUDA" FAIL "torch $torch_version sees no GPU"; fi

start=$(date +%s)
timeout 150 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" >"$OUT/gpu_tests.log" 2>&1
rc=$?
summary=$(tail -n 1 "$OUT/gpu_tests.log")
if [ $rc -eq 0 ] && ! grep -q skipped <<<"$summary"; then status=PASS; else status=FAIL; fi
row "pytest -m gpu" "$status" "$summary ($(( $(date +%s) - start )) s, exit $rc)"

start=$(date +%s)
timeout 420 "$PYTHON" -m specdraft.cli rehearse --out "$OUT/rehearsal" --device cuda --tokenizer "$TOKENIZER" \
  >"$OUT/rehearsal.log" 2>&1
rc=$?
if [ -f "$OUT/rehearsal/rehearsal_summary.json" ]; then
  while IFS=$'\t' read -r name ok detail; do row "rehearsal: $name" "$ok" "$detail"; done < <("$PYTHON" - "$OUT" <<'PY'
import json, sys
summary = json.load(open(f"{sys.argv[1]}/rehearsal/rehearsal_summary.json"))
for c in summary["checks"]:
    print(c["name"], "PASS" if c["ok"] else "FAIL", c["detail"].replace("|", "/"), sep="\t")
PY
)
fi
row "rehearse --device cuda" "$([ $rc -eq 0 ] && echo PASS || echo FAIL)" "exit $rc in $(( $(date +%s) - start )) s ($OUT/rehearsal.log)"

{
  echo "| check | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/gpu_smoke.md"
grep -q "| FAIL |" "$OUT/gpu_smoke.md" && exit 1 || exit 0

#!/usr/bin/env bash
# The issue-11 device check: one CUDA GPU, that machine's own torch (2.11) and triton (3.6), no
# network. Writes $OUT/device_check.md, $OUT/device_check.json and $OUT/device_check.tgz (every
# part's JSON and log; packed because the device tool brings back at most 8 files). docs/gpu.md
# gives the exact call.
#
#   OUT=/some/dir bash benchmarks/device_check.sh
#
# Parts, most important first, each under its own time limit and all under one deadline
# (BUDGET_S, default 470 s, so the whole ends within 8 minutes); a part that fails, runs out of
# time or is not reached is reported as such:
#   1. rzero check --device cuda, invariant: tiny-dense and tiny-moe in bf16 and fp32
#   2. 50 steps of the default job on cuda: mismatch/kernel_max_abs exactly 0.0 at every step
#   3. invariant / standard time at the Qwen3-0.6B shape: decode step (batch 64), train step (16 x 512)
#   4. engine vs transformers generate, same 0.6B-shaped model, batch 64, 128 new tokens
#   5. rzero check --device cuda, invariant, the 0.6B-shaped random model in bf16
#   6. the negative controls: the same checks under standard numerics
# Missing pure-Python packages travel as wheels in $WHEELS (default: .whl at the repository root,
# filled by benchmarks/device_wheels.sh); they are installed with --no-index --no-deps into a
# folder of this run, never into the machine's environment.
set -u -o pipefail
OUT=${OUT:?set OUT to the directory for the results}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
RESULTS="$WORK/results"
PARTS="$RESULTS/parts"
mkdir -p "$PARTS" "$OUT"
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-470} ))

# At exit, after an error too: the summary beside the packed parts and logs.
pack() {
  cp "$RESULTS/device_check.md" "$RESULTS/device_check.json" "$OUT/" 2>/dev/null
  tar czf "$OUT/device_check.tgz" -C "$RESULTS" . && echo "parts and logs packed into $OUT/device_check.tgz"
  rm -rf "$WORK"
}
trap pack EXIT

# The interpreter with torch. On the lent H200 machines the python3 on PATH has no torch; torch is
# in a virtual environment (/opt/torch/.venv/bin/python3). It is called by its own path: a link to
# it from elsewhere no longer finds its environment. Every probe has a time limit.
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3 python /opt/*/.venv/bin/python3; do
    path=$(command -v "$candidate") || continue
    if timeout 60 "$path" -c "import torch" 2>/dev/null; then PYTHON=$path; break; fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "no Python interpreter with torch found (set PYTHON=...)" | tee "$RESULTS/error.log"
  exit 2
fi
echo "python: $PYTHON"
export PYTHON

WHEELS=${WHEELS:-$ROOT/.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
    "$WHEELS"/*.whl >"$RESULTS/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
  export PYTHONPATH="$WORK/site"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="$PYTHON $ROOT/benchmarks/device_check.py"

# part NAME SECONDS COMMAND...: run with a time limit (cut to what is left before the deadline),
# log to NAME.log, note the outcome.
part() {
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local t0=$(date +%s)
  local left=$(( DEADLINE - t0 ))
  if [ "$left" -lt 10 ]; then
    echo "$name: not run (deadline)"
    printf '{"error": "not run: the %s s budget was spent"}\n' "${BUDGET_S:-470}" >"$PARTS/$name.json"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - t0 )) s (total $(( $(date +%s) - START )) s)"
  if [ $rc -ne 0 ] && [ ! -s "$PARTS/$name.json" ]; then
    local why="exit $rc"
    [ $rc -eq 124 ] && why="over its $limit s limit"
    printf '{"error": "%s; see %s.log"}\n' "$why" "$name" >"$PARTS/$name.json"
  fi
}

# rzero check exits 1 when a check fails (expected under standard): keep its JSON either way.
check() {
  local name=$1; shift
  "$PYTHON" -m rzero.cli check --device cuda --json "$@" >"$PARTS/$name.json"
  local rc=$?
  [ $rc -le 1 ] && return 0 || return $rc
}
export -f check
export PARTS

part preflight 120 $PY preflight "$PARTS/preflight.json"
cat "$PARTS/preflight.json"

part init_models 120 bash -c '"$PYTHON" -m rzero.cli init-model --preset tiny-dense --out "$1/tiny-dense" \
  && "$PYTHON" -m rzero.cli init-model --preset tiny-moe --out "$1/tiny-moe"' _ "$WORK"

# rzero check of both tiny presets in both dtypes under NUMERICS, each part given SECONDS.
tiny_checks() {
  local numerics=$1 seconds=$2 preset dtype
  for preset in tiny-dense tiny-moe; do
    for dtype in bf16 fp32; do
      part "check_${preset}_${dtype}_${numerics}" "$seconds" bash -c 'check "$@"' _ "check_${preset}_${dtype}_${numerics}" \
        --model "$WORK/$preset" --dtype "$dtype" --numerics "$numerics"
    done
  done
}

# The invariant checks first: under the deadline, the claim goes before its controls.
tiny_checks invariant 60

part train 150 bash -c '"$PYTHON" -m rzero.cli train --steps 50 --set model.device=cuda --out "$1/run" \
  && "$PYTHON" "$2" train-metrics "$1/run" "$3/train.json"' _ "$WORK" "$ROOT/benchmarks/device_check.py" "$PARTS"

part make_model 60 $PY make-model "$WORK/qwen3-0.6b-shape"
part timing 90 $PY timing "$WORK/qwen3-0.6b-shape" "$PARTS/timing.json"
part engine_vs_hf 120 $PY engine-vs-hf "$WORK/qwen3-0.6b-shape" "$PARTS/engine_vs_hf.json"
part check_qwen3-0.6b-shape_bf16_invariant 60 bash -c 'check "$@"' _ check_qwen3-0.6b-shape_bf16_invariant \
  --model "$WORK/qwen3-0.6b-shape" --dtype bf16 --numerics invariant

tiny_checks standard 30
part check_qwen3-0.6b-shape_bf16_standard 90 bash -c 'check "$@"' _ check_qwen3-0.6b-shape_bf16_standard \
  --model "$WORK/qwen3-0.6b-shape" --dtype bf16 --numerics standard

timeout 60 $PY summarize "$PARTS" "$RESULTS"
echo "device check done in $(( $(date +%s) - START )) s"

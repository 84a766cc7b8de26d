#!/usr/bin/env bash
# The issue-11 device check: one CUDA GPU, that machine's own torch (2.11) and triton (3.6), no
# network. Writes $OUT/device_check.json and $OUT/device_check.md (plus the logs of each part).
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
# Missing pure-Python packages can travel as wheels in benchmarks/wheels/ (installed with
# --no-index; nothing is fetched).
set -u -o pipefail
OUT=${OUT:?set OUT to the directory for the results}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PARTS="$OUT/parts"
WORK=$(mktemp -d)
mkdir -p "$PARTS"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="python $ROOT/benchmarks/device_check.py"
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-470} ))

if [ -d "$ROOT/benchmarks/wheels" ]; then
  pip install --no-index --find-links "$ROOT/benchmarks/wheels" "$ROOT/benchmarks/wheels"/*.whl >"$OUT/wheels.log" 2>&1 \
    || echo "wheel install failed (see wheels.log)"
fi

# part NAME SECONDS COMMAND...: run with a time limit (cut to what is left before the deadline),
# log to $OUT/NAME.log, note the outcome.
part() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  local left=$(( DEADLINE - t0 ))
  if [ "$left" -lt 10 ]; then
    echo "$name: not run (deadline)"
    printf '{"error": "not run: the %s s budget was spent"}\n' "${BUDGET_S:-470}" >"$PARTS/$name.json"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
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
  python -m rzero.cli check --device cuda --json "$@" >"$PARTS/$name.json"
  local rc=$?
  [ $rc -le 1 ] && return 0 || return $rc
}
export -f check
export PARTS

$PY preflight "$PARTS/preflight.json" >"$OUT/preflight.log" 2>&1
cat "$PARTS/preflight.json"

python -m rzero.cli init-model --preset tiny-dense --out "$WORK/tiny-dense" >/dev/null
python -m rzero.cli init-model --preset tiny-moe --out "$WORK/tiny-moe" >/dev/null

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

part train 150 bash -c "python -m rzero.cli train --steps 50 --set model.device=cuda --out '$WORK/run' \
  && $PY train-metrics '$WORK/run' '$PARTS/train.json'"

part make_model 60 $PY make-model "$WORK/qwen3-0.6b-shape"
part timing 90 $PY timing "$WORK/qwen3-0.6b-shape" "$PARTS/timing.json"
part engine_vs_hf 60 $PY engine-vs-hf "$WORK/qwen3-0.6b-shape" "$PARTS/engine_vs_hf.json"
part check_qwen3-0.6b-shape_bf16_invariant 60 bash -c 'check "$@"' _ check_qwen3-0.6b-shape_bf16_invariant \
  --model "$WORK/qwen3-0.6b-shape" --dtype bf16 --numerics invariant

tiny_checks standard 30
part check_qwen3-0.6b-shape_bf16_standard 40 bash -c 'check "$@"' _ check_qwen3-0.6b-shape_bf16_standard \
  --model "$WORK/qwen3-0.6b-shape" --dtype bf16 --numerics standard

$PY summarize "$PARTS" "$OUT"
echo "device check done in $(( $(date +%s) - START )) s"
rm -rf "$WORK"

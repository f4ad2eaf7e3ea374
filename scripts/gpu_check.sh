#!/usr/bin/env bash
# The GPU check: the one command for a lent GPU machine (docs/gpu.md, "Running the GPU check").
#
#   scripts/gpu_check.sh            on the GPU machine, after scripts/gpu_wheels.sh here and with
#                                   carry: [".whl"]; at most 8 minutes
#   scripts/gpu_check.sh --dry-run  the same steps on the CPU at tiny sizes (the suite runs it)
#   GPU_CHECK_BENCH="nano_vllm moe" scripts/gpu_check.sh    these benchmarks only (keys or prefixes)
#
# Steps, each with its own timeout; a failing step is reported and the next one runs:
#   install  the carried wheels (.whl/*.whl) into $GPU_CHECK_SITE (/tmp/site), put on PYTHONPATH
#   env      GPU, driver, torch/triton versions; every carried package imports and is satisfied
#   tests    pytest -m gpu (the GPU tests; on the CPU they are all skipped), log in $OUT/pytest.log
#   bench    the benchmarks with their rooflines (python -m splitserve.benchmarks.gpu_check)
# then one summary ($OUT/gpu_check.json and a table). Output: $OUT (default /tmp/gpu-check), with
# gpu_check.log, pytest.log, junit.xml, bench.log and gpu_check.json. Exits 1 if a test or a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
OUT=${OUT:-/tmp/gpu-check}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TOTAL=${GPU_CHECK_SECONDS:-480} # the whole check, summary included
# What the tests step collects (paths, space-separated): unless told, the modules that mark tests gpu
# (collecting every module would import every test-only package, which the wheels need not carry, and
# takes 13 s on CPU).
TESTS=${GPU_CHECK_TESTS:-$(grep -rl --include='test_*.py' 'pytest\.mark\.gpu' tests | sort | tr '\n' ' ')}
# Which benchmarks the bench step runs (keys or prefixes, space-separated, as its --only): all, unless told.
BENCH_ONLY=${GPU_CHECK_BENCH:-}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
mkdir -p "$OUT"
rm -f "$OUT/steps.tsv" "$OUT/env.json" "$OUT/bench.json" "$OUT/junit.xml" "$OUT/gpu_check.json"
: >"$OUT/bench.log"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$SECONDS

# step NAME CAP_SECONDS COMMAND...: runs COMMAND for at most CAP seconds (less if the whole check's
# time runs short) and records "name rc seconds note" in steps.tsv.
step() {
    local name=$1 cap=$2 note=""
    shift 2
    local left=$((TOTAL - (SECONDS - START) - 15))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 5 ]; then
        printf '%s\t1\t0\tnot run: the check is out of time\n' "$name" >>"$OUT/steps.tsv"
        return
    fi
    echo "=== $name (at most $limit s)"
    local begin=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@"
    local rc=$?
    if [ "$rc" -eq 124 ]; then note="timed out after $limit s"; fi
    printf '%s\t%d\t%d\t%s\n' "$name" "$rc" $((SECONDS - begin)) "$note" >>"$OUT/steps.tsv"
    echo "=== $name: rc $rc in $((SECONDS - begin)) s $note"
}

if [ "$DRY" = 1 ]; then
    echo "=== install: dry run, this environment's packages"
    printf 'install\t0\t0\tdry run: not installed\n' >>"$OUT/steps.tsv"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    step install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
step env 60 bash -c 'if command -v nvidia-smi >/dev/null; then nvidia-smi; fi; exec "$0" "$@"' \
    "$PY" scripts/gpu_check.py env --out "$OUT" --site "$SITE"
step tests 260 bash -c 'set -o pipefail; "$0" -m pytest -m gpu -q -p no:cacheprovider --durations=25 --continue-on-collection-errors \
    --junitxml="$1/junit.xml" $2 2>&1 |
    tee -i "$1/pytest.log"' "$PY" "$OUT" "$TESTS"
BENCH_BUDGET=$((TOTAL - (SECONDS - START) - 30))
bench_args=(--out "$OUT" --budget "$BENCH_BUDGET" --no-table)
if [ "$DRY" = 1 ]; then bench_args+=(--dry-run); fi
# shellcheck disable=SC2206 # the keys are words
if [ -n "$BENCH_ONLY" ]; then bench_args+=(--only $BENCH_ONLY); fi
step bench $((BENCH_BUDGET + 10)) "$PY" -m splitserve.benchmarks.gpu_check "${bench_args[@]}"

summary_args=(--out "$OUT")
if [ "$DRY" = 1 ]; then summary_args+=(--dry-run); fi
"$PY" scripts/gpu_check.py summary "${summary_args[@]}"

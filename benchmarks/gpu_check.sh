#!/usr/bin/env bash
# The one prepared device check (issue 41): on one H100 or H200, in at most 6 minutes, from the repository
# root, with no network and no hydra:
#   1. the gpu-marked tests (python -m pytest -m gpu on the files below);
#   2. the GPU attention benchmark at N = 2, 4, 8 with an `auto` row among the kernels, and its packed
#      replay, as docs/benchmarks/<date>-gpu-<device>.json (its "device" field names the GPU);
#   3. the markdown record beside it (benchmarks/gpu_record.py), headed "measured on <GPU name>".
# With $OUT set (the device machine's return folder) the JSON, the record and the logs are copied there.
#
# Budget, from the first H200 run (../shared/gpu-2026-11-27): the gpu tests took 49 s; the benchmark
# costs about 11 s per timed repeat at N = 2, 4, 8 (kernels ~2.7 s, dense replays ~2.8 s, packed replays
# ~4 s, SDPA ~0.4 s, per repeat summed over N; each measurement repeats + 1 warm-up), so 7 repeats take
# ~100 s. Each step has a time limit so the whole check ends by 6 minutes even when something hangs.
#
# Environment: GPU_CHECK_REPEATS (default 7), GPU_CHECK_TRAIN=1 adds tests/system/test_train_gpu.py
# (needs hydra-core and ~150 s more: over the budget, so off by default), CP_ATTENTION_COMMIT names the
# commit where there is no git checkout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
started=$(date +%s)

REPEATS="${GPU_CHECK_REPEATS:-7}"
DATE="$(date +%F)"
SLUG="$(python -c 'import torch; from benchmarks.gpu_record import device_slug
print(device_slug(torch.cuda.get_device_name()))')" \
    || { echo "gpu_check: no CUDA device (torch.cuda.get_device_name failed); run it on a GPU machine" >&2; exit 2; }
GPU_NAME="$(python -c 'import torch; print(torch.cuda.get_device_name())')"
if COMMIT="$(git rev-parse --short HEAD 2>/dev/null)"; then
    [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || COMMIT="$COMMIT+uncommitted"
else
    COMMIT="${CP_ATTENTION_COMMIT:-unknown}"
fi

# A second run on the same day and GPU gets its own name (-2, -3, ...): both records are kept.
BASE="docs/benchmarks/${DATE}-gpu-${SLUG}"
n=2
NAME="$BASE"
while [ -e "$NAME.json" ] || [ -e "$NAME.md" ]; do NAME="$BASE-$n"; n=$((n + 1)); done
JSON="$NAME.json"
LOGS="${OUT:-$(mktemp -d)}"
mkdir -p "$LOGS"
TEST_LOG="$LOGS/$(basename "$NAME").pytest.log"
BENCH_LOG="$LOGS/$(basename "$NAME").attention.log"
echo "gpu_check: $GPU_NAME, commit $COMMIT, repeats $REPEATS -> $JSON (logs in $LOGS)"

TEST_FILES=(tests/unit/kernels/test_cuda.py tests/unit/engine/test_ring_cuda.py tests/adapters/hf/test_cuda.py
            tests/adapters/hf/test_generate.py tests/system/test_benchmark_cuda.py)
if [ "${GPU_CHECK_TRAIN:-0}" = 1 ]; then TEST_FILES+=(tests/system/test_train_gpu.py); fi
timeout -k 10 "${GPU_CHECK_TEST_TIMEOUT:-130}" python -m pytest -m gpu -q -rf "${TEST_FILES[@]}" 2>&1 \
    | tee "$TEST_LOG"
tests_rc=${PIPESTATUS[0]}

BENCH=(benchmarks/attention.py --device cuda --world-sizes 2 4 8 --kernels auto cudnn flash efficient
       --repeats "$REPEATS" --json "$JSON")
timeout -k 10 "${GPU_CHECK_BENCH_TIMEOUT:-190}" python "${BENCH[@]}" 2>&1 | tee "$BENCH_LOG"
bench_rc=${PIPESTATUS[0]}

record_rc=1
if [ -s "$JSON" ]; then  # written after every N: a run cut short still gets a (marked incomplete) record
    RECORD=(-m benchmarks.gpu_record "$JSON" --commit "$COMMIT" --date "$DATE" --tests "$TEST_LOG")
    python "${RECORD[@]}" && record_rc=0
    if [ -n "${OUT:-}" ]; then cp "$JSON" "$NAME.md" "$OUT/" 2>/dev/null; fi
fi

echo "gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc, record rc=$record_rc (0: $JSON and $NAME.md written)," \
     "$(( $(date +%s) - started )) s"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$record_rc" = 0 ]

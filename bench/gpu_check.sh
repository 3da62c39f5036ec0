#!/usr/bin/env bash
# The GPU check of issue 26, as one script for a lent GPU machine (or any CUDA host):
#   bash bench/gpu_check.sh [OUTDIR]
# 1. tests/test_gpu.py (several workers, sync over NCCL, variable-length bags, a bf16 wire, the
#    GPU preset), tests/test_gpu_overlap.py, and the row cache on the device (tests/test_device_cache.py;
#    tests/test_gpu_cache.py runs it in real jobs, a few minutes more: run it by hand);
# 2. bench/model_throughput.py --preset gpu --device cuda --num-shards auto, 3 separate invocations
#    (the target: the parameter server's share of a CUDA step <= 20%, and samples/s against the
#    same model in one process on that GPU), with the shards tether launch starts on this host for
#    one GPU worker and the preset's push window (2); SHARDS=1 measures one shard as before; each
#    invocation also runs the job with the row cache on the GPU at CACHE (default 20/20, the bound
#    bench/RESULTS.md recommends, with the default admission, recurring; CACHE= leaves it out;
#    CACHE_ADMISSION=all runs it with --cache-admission all), its share and ratio in the same table;
# 3. the default model on cuda once, against the figures of 572805c in bench/RESULTS.md;
# and, after the tests (which add tests/test_pinned_regions.py), bench/region_pull.py: whether the
#    platform registers a shard's shared region as pinned memory, and a preset gpu pull onto the
#    GPU straight from the region against one copy into pinned memory first (ms and worker CPU ms);
# last, with CACHE set, bench/traffic.py --preset gpu --on-device --device cuda --passes: the row
#    cache on the GPU behind a stand-in client (no shard), its calls' host CPU a step (a CUDA sync
#    spins, so waits on the GPU count) and its compiled host passes one by one.
# Each part is bounded by `timeout`, and its output goes to OUTDIR (default: runs/gpu-check). The
# whole check is bounded too, since the lent machine's call is (10 minutes): each part's timeout is
# capped by what is left of TOTAL_S (default 570 s), a part is skipped, saying so, once under 20 s
# are left, and every part's seconds go to OUTDIR/timing.txt (to size the parts for the next run).
# On a machine with no package index, wheels in .whl/ (grpcio, protobuf, grpcio-health-checking)
# are installed into /tmp/site first.
set -u
OUTDIR=${1:-runs/gpu-check}
mkdir -p "$OUTDIR"
TOTAL_S=${TOTAL_S:-570}
START=$SECONDS
: > "$OUTDIR/timing.txt"
# part LABEL LIMIT_S LOG COMMAND...: COMMAND bounded by min(LIMIT_S, what is left of TOTAL_S), its
# output shown and written to LOG; skipped (the LOG says so) once under 20 s are left.
part() {
    local label=$1 limit=$2 log=$3 left t0
    shift 3
    echo "== $label"
    left=$(( TOTAL_S - (SECONDS - START) ))
    if [ "$left" -lt 20 ]; then
        echo "skipped: $(( SECONDS - START )) s of the check's TOTAL_S=$TOTAL_S spent" | tee "$log"
        echo "$label: skipped" >> "$OUTDIR/timing.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$log"
    echo "$label: $(( SECONDS - t0 )) s (limit $limit s)" >> "$OUTDIR/timing.txt"
}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import tether" 2>/dev/null || $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
{
    date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi -L; nproc
    $PY -c "import torch, grpc, google.protobuf as pb, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'numba', numba.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUTDIR/machine.txt"

part "tests" "${TESTS_S:-240}" "$OUTDIR/tests.log" $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_overlap.py \
    tests/test_device_cache.py tests/test_pinned_regions.py

part "a preset gpu pull onto the GPU: straight from the shared region, and with one copy into pinned memory" "${REGION_BENCH_S:-120}" \
    "$OUTDIR/region-pull.log" $PY bench/region_pull.py

CACHE=${CACHE-20/20}
CACHE_ARGS=()
if [ -n "$CACHE" ]; then CACHE_ARGS=(--cache "$CACHE" --cache-admission "${CACHE_ADMISSION:-recurring}"); fi
for i in 1 2 3; do
    part "preset gpu, invocation $i" "${GPU_BENCH_S:-150}" "$OUTDIR/preset-gpu-$i.log" $PY bench/model_throughput.py --preset gpu --device cuda \
        --steps "${GPU_STEPS:-150}" --num-shards "${SHARDS:-auto}" "${CACHE_ARGS[@]}"
done

part "default model on cuda" "${DEFAULT_BENCH_S:-90}" "$OUTDIR/default-cuda.log" $PY bench/model_throughput.py --device cuda \
    --steps "${DEFAULT_STEPS:-1000}"

if [ -n "$CACHE" ]; then
    part "the row cache on the GPU at preset gpu: its calls' host CPU a step and its host passes" "${CACHE_PASSES_S:-90}" \
        "$OUTDIR/cache-passes.log" $PY bench/traffic.py --preset gpu --steps 40 --bounds "$CACHE" --on-device --device cuda \
        --admission "${CACHE_ADMISSION:-recurring}" --passes
fi
echo "== seconds a part (of TOTAL_S=$TOTAL_S)"
cat "$OUTDIR/timing.txt"

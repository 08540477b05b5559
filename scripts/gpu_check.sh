#!/usr/bin/env bash
# One prepared run of everything a lent GPU machine can show (docs/gpu-results.md), on a
# machine with no package registry: its own python3 (torch, torchvision, Triton) plus pure-Python
# and manylinux wheels carried in .whl/ (DeepSpeed, webdataset, faiss-cpu and their needs; DALI is too
# big to carry, so the loader is the torchvision fallback).  Each item has its own time limit and its
# own section of $OUT/gpu-check.log, and a failing item does not stop the next.  Run from the repo root:
#   OUT=out/gpu-check scripts/gpu_check.sh [ITEM ...]     (items: see the case below; default: all but
#   `fused`, whose GPU tests `pytest` runs too)
set -u
OUT=${OUT:-out/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG=$OUT/gpu-check.log
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 || echo "wheel install failed: see $LOG"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
CLI="$PY -m trainer.cli"

item() {  # item LIMIT_S NAME COMMAND...: one section of the log, its exit code and seconds
    local limit=$1 name=$2
    shift 2
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - began)) s" | tee -a "$LOG"
}

# ImageNet-21K on 64 GPUs: one rank's shard of the classifier, the global batch's two views.
IN21K_RANK_ROWS=221830
FEATURES=8192

env_facts() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    $PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
    $PY -c "import deepspeed, webdataset, faiss; print('deepspeed', deepspeed.__version__, 'faiss', faiss.__version__)"
    $PY -m trainer.bench.device_ceilings | tee "$OUT/ceilings.json"
}

export -f env_facts
export PY OUT
# Highest value first (docs/gpu-results.md keeps the ranked list and what each lending measured).
ITEMS=${*:-env step syncbn sweep selftest pytest step-compiled classifier dry-run classifier-1m}
# The autotuner's timing runs allocate: memory comparisons (dry run, tests) take each kernel's first config.
for what in $ITEMS; do
    case $what in
    env) item 60 env bash -c env_facts ;;
    selftest) item 240 selftest $CLI selftest --json "$OUT/selftest.json" ;;
    classifier) item 150 "bench classifier N=$IN21K_RANK_ROWS" $CLI bench classifier --ranks 1 \
        --num-classes $IN21K_RANK_ROWS --batch $FEATURES --dim 128 --dtype bfloat16 --steps 10 --warmup 2 \
        --json "$OUT/classifier-in21k-rank.json" ;;
    dry-run) item 200 "dry run vs device (in21k, rank 0 of 64)" env INSTCLS_FUSED_AUTOTUNE=0 $CLI dry-run --config configs/in21k_r50_64gpu.yaml \
        --ranks 64 --num-instances 14197122 --compare 0 --steps 4 --set objective.smoothing_alpha=0 --on-device ;;
    fused) item 240 "fused kernels vs float64 on the GPU" env INSTCLS_TEST_GPU=1 $PY -m pytest -p no:cacheprovider \
        -m gpu tests/unit/test_fused_kernel.py -q -rA ;;
    step) for ds in ${STEP_DS:-zero0_autocast_bf16 zero2_bf16 zero1_bf16}; do  # the shipped one first
        item 150 "bench step ResNet-50 $ds, beside its plain baseline" $CLI bench step \
            --config configs/in21k_r50_64gpu.yaml --ranks 1 --steps 15 --warmup 5 --baseline \
            --set deepspeed_config=ds_configs/$ds.json --json "$OUT/step-$ds.json"
        done ;;
    step-compiled) item 300 "bench step ResNet-50, backbone compiled" $CLI bench step \
        --config configs/in21k_r50_64gpu.yaml --ranks 1 --steps 15 --warmup 10 --baseline \
        --set model.compile=true --json "$OUT/step-compiled.json" ;;
    step-loader) item 200 "bench step ResNet-50 through the torch loader" $CLI bench step \
        --config configs/in21k_r50_64gpu.yaml --ranks 1 --steps 15 --warmup 5 --data loader --image-size 160 \
        --set data.loader.backend=torch --json "$OUT/step-loader.json" ;;
    sweep) item 240 "DDP vs DHP, rank 0 of 64 on this GPU" $CLI bench ddp-vs-dhp --ranks 64 --batch 4096 \
        --fake-devices 32 --on-device ;;
    classifier-1m) item 150 "bench classifier N=1000000" $CLI bench classifier --ranks 1 --num-classes 1000000 \
        --batch $FEATURES --dim 128 --dtype bfloat16 --steps 10 --warmup 2 --json "$OUT/classifier-1m.json" ;;
    syncbn) item 120 "SyncBatchNorm's fused kernels: pseudo-ranks vs float64, cost at ResNet-50's shapes" \
        $PY -m trainer.bench.sync_batch_norm_check --batch 64 --json "$OUT/sync-batch-norm.json" ;;
    pytest) item 300 "make test-gpu-offline" env INSTCLS_FUSED_AUTOTUNE=0 make test-gpu-offline PYTHON="$PY" ;;
    *) echo "unknown item $what" | tee -a "$LOG" ;;
    esac
done
grep "^=== " "$LOG"

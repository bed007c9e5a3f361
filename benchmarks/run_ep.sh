#!/usr/bin/env bash
# The multi-GPU run in parts that each fit one 10-minute device call (P = GPUs of the host, one process each):
#
#   bash benchmarks/run_ep.sh P OUT checks            # links, transport ceilings, the EP tests at P, a tiny smoke run
#   bash benchmarks/run_ep.sh P OUT routed [SHAPES [OPTIONS]]   # bench_ep, routed experts, forward and fwd + bwd
#   bash benchmarks/run_ep.sh P OUT layer [SHAPES [OPTIONS]]    # bench_ep, routed + shared expert
#
# OUT: where the records (h200x<P>_ceilings.json, h200x<P>_ep.json) and the logs go ($OUT on the device machine);
# SHAPES: comma-separated (default: every multi-GPU shape, benchmarks/shapes.py EP_SHAPES; at EP=2 a shape took
# 2-3 minutes, so give a call two of them); OPTIONS: passed on to bench_ep (e.g. --variant "pull 16: pull_programs=16";
# a shape then takes longer: STEP_S, default 280, is each shape's time limit). "checks" measures the link ceilings
# with tools/ep_ceilings.py. One bench_ep process per shape: a shape that runs out of time leaves the others' records. Each
# step has its own time limit and prints its status; the script goes on after a failed step. NVLink multicast
# stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST).
set -u
P=${1:?usage: run_ep.sh P OUT checks|routed|layer [SHAPES]}
OUT=${2:?usage: run_ep.sh P OUT checks|routed|layer [SHAPES]}
PART=${3:?usage: run_ep.sh P OUT checks|routed|layer [SHAPES]}
SHAPES=${4:-}
shift $(($# < 4 ? $# : 4))
OPTIONS=("$@")
cd "$(dirname "$0")/.."
SHAPES=${SHAPES:-$(python -c "import sys; sys.path.insert(0, 'benchmarks'); from shapes import EP_SHAPES; print(','.join(EP_SHAPES))")}
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
TORCHRUN=(python -m torch.distributed.run --standalone --nproc-per-node "$P")

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.txt, print its tail
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: rc=$? ($(date -u +%H:%M:%S))"
    grep -v "^ *$" "$OUT/$name.txt" | tail -12
}

date -u
nvidia-smi --query-gpu=index,name,driver_version,power.limit --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
case $PART in
    checks)
        nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
        nvidia-smi nvlink -s >> "$OUT/topo.txt" 2>&1
        head -12 "$OUT/topo.txt"
        step ceilings 180 "${TORCHRUN[@]}" tools/ep_ceilings.py --out "$OUT/h200x${P}_ceilings.json"
        step test_ep 240 python -m pytest -q tests/test_ep.py -k one_gpu_per_rank   # P = 2, 4, 8 up to the GPUs
        step smoke 90 "${TORCHRUN[@]}" benchmarks/bench_ep.py --tiny --device cuda --out "$OUT/h200x${P}_ep_tiny.json"
        ;;
    routed | layer)
        for shape in ${SHAPES//,/ }; do
            step "${PART}_$shape" "${STEP_S:-280}" "${TORCHRUN[@]}" benchmarks/bench_ep.py --shapes "$shape" \
                --scopes "$PART" --out "$OUT/h200x${P}_ep.json" "${OPTIONS[@]}"
        done
        ;;
    *)
        echo "unknown part $PART: checks, routed or layer"
        exit 2
        ;;
esac
date -u

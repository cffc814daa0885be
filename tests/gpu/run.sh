#!/usr/bin/env bash
# The GPU checks, in one run (under 10 minutes on one node): tests/gpu (NCCL layouts need 2-4 GPUs and are
# skipped with fewer), then the benchmarks that take --device cuda, at small sizes, each beside its PyTorch peer.
# On a machine with CUDA and the project installed (pip install --no-deps -e . where no package index is reachable):
#   bash tests/gpu/run.sh            # JSON of each benchmark under gpu-results/ (meshlm from src/ if not installed)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${GPU_RESULTS:-gpu-results}
mkdir -p "$out"
status=0
# meshlm from this checkout when it is not installed (an image without a package index may lack pip's build deps)
python -c "import meshlm" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
echo "visible GPUs: $gpus"
if [ "$gpus" -lt 1 ]; then
    echo "no CUDA device: nothing to check here" >&2
    exit 1
fi
timeout 420 python -m pytest tests/gpu -q -rs -p no:cacheprovider || status=1
ranks=$(( gpus >= 2 ? 2 : 1 ))
bench() {  # name, then its arguments; BENCH_AS names the output files (default: the name)
    local name=$1; shift
    local as=${BENCH_AS:-$name}
    echo "== benchmarks/$name.py $*"
    if ! timeout 120 python "benchmarks/$name.py" "$@" > "$out/$as.json" 2> "$out/$as.err"; then
        status=1
        tail -5 "$out/$as.err"
    fi
}
bench train_step --device cuda
# Llama 3 8B's layer shapes (2 of its 32 layers, its 128k vocabulary) at 4096 tokens: MFU where it is meant
BENCH_AS=train_step_8b_layers bench train_step --preset llama3-8b --set num_layers=2 --device cuda --batch 2 \
    --seq-len 4096 --steps 5 --warmup 2
if [ "$gpus" -ge 2 ]; then
    bench dp --device cuda --rounds 2 --warmup 1
    bench pp --device cuda --world-sizes 2 --steps 3
    bench tp --device cuda --world-sizes 2 --steps 5
    bench zero --device cuda --world-sizes 2 --steps 5
    bench cp --device cuda --cps 1,2
fi
echo "results in $out/ (exit $status)"
exit $status

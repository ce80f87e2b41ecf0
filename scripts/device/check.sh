#!/bin/bash
# The device check, on a GPU machine over what scripts/device/pack.sh packed into .gpu/: make
# test-gpu's recipe (the GPU tests, then compute-sanitizer memcheck and racecheck), make
# bench-gpu's, and the server end to end on CUDA against the CPU (scripts/device/smoke.py), plus
# `kvserve bench` on both. STEPS picks some (default: the first six): probe tests sanitize bench
# smoke kvbench emu profile (ncu's time for every kernel of gpu_bench at 2 layers) peer. The
# model is pack.sh's 4-layer cut of the default model. Each step's log goes to $OUT (or
# /tmp/kvcheck); a step that fails is reported and the rest run.
#
# peer, over pack.sh's .gpu-peer (a call of its own: STEPS=peer, carry [".gpu-peer"]): kvserve
# beside llama.cpp's CUDA build. Writes a Llama 3 8B shape file (Q4_K, random weights, as
# gpu_bench's: make_bench_model.py --llama3-8b, with the carried gguf wheel), then runs
# scripts/bench/vs_llamacpp.py --device cuda (kvserve bench vs llama-bench -ngl 99 -fa on: pp512
# pp2048 tg128 tg64@4096, README's earlier figures beside them; on the 4-layer cut too where an
# earlier call on the same machine left it) and scripts/bench/serve.py --device cuda (1 and 32
# streaming clients through kvserve serve and llama-server -np 32: aggregate tokens/s and TTFT)
# on that file. PEER_DEVICE=cpu and PEER_LAYERS=N run the same on the CPU and a cut.
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-probe tests sanitize bench smoke kvbench}
LOG=${OUT:-/tmp/kvcheck}; mkdir -p "$LOG"
K=/tmp/kvpack; rm -rf $K; mkdir -p $K/need
for p in .gpu .gpu-peer; do [ ! -f $p/pack.tar.xz ] || tar xJf $p/pack.tar.xz -C $K || exit 1; done
[ -d $K/bin ] || { echo "no .gpu/pack.tar.xz nor .gpu-peer/pack.tar.xz: run" \
    "scripts/device/pack.sh here, and carry one"; exit 1; }
for l in $K/lib/*; do ldconfig -p | grep -q "^\s*$(basename $l) " || cp $l $K/need/; done
export LD_LIBRARY_PATH=$K/need
mkdir -p build/gpu-tests models
for b in $K/bin/*; do # .gpu-peer holds kvserve and the peer alone
    case ${b##*/} in cuda_*) cp $b build/gpu-tests/ ;; kvserve | gpu_bench) cp $b build/ ;; esac
done
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
cp $K/models/*.gguf models/
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() { # step NAME TIMEOUT CMD...: runs CMD, its output to $LOG/NAME.log, the last TAIL lines
    local name=$1 t=$2; shift 2 # (25) to the console
    echo "== $name ($(date +%T))"
    timeout $t "$@" >"$LOG/$name.log" 2>&1; local rc=$?
    tail -n "${TAIL:-25}" "$LOG/$name.log"; echo "== $name: rc $rc"
    [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
echo "libraries carried: $(ls $K/need | tr '\n' ' ')"
ldd build/kvserve build/gpu-tests/cuda_test | grep "not found"
has probe && step probe 60 build/gpu_bench --probe
if has tests; then
    for t in cuda_test cuda_forward_test cuda_emu_test; do step $t 120 build/gpu-tests/$t --jobs 1; done
elif has emu; then
    step cuda_emu_test 120 build/gpu-tests/cuda_emu_test --jobs 1
fi
# the figures before the sanitizers: a call that runs out of time keeps them
has bench && step bench 200 build/gpu_bench
if has sanitize; then
    for tool in memcheck racecheck; do
        step $tool 150 $SAN --tool $tool --target-processes all --error-exitcode 1 \
            build/gpu-tests/cuda_test --jobs 1
    done
    step memcheck_forward 150 $SAN --tool memcheck --leak-check full --target-processes all \
        --error-exitcode 1 build/gpu-tests/cuda_forward_test --jobs 1 --filter 'cuda_forward/tiny*'
fi
if has smoke; then
    step smoke 150 bash -c "build/kvserve serve -m $MODEL --device cuda --port 8091 --cache-dir /tmp/c1 >$LOG/serve_cuda.txt 2>&1 & a=\$!;
        build/kvserve serve -m $MODEL --device cpu -t 8 --port 8092 --cache-dir /tmp/c2 >$LOG/serve_cpu.txt 2>&1 & b=\$!;
        python3 scripts/device/smoke.py http://127.0.0.1:8091 http://127.0.0.1:8092; rc=\$?; kill \$a \$b; wait; exit \$rc"
fi
if has profile; then
    # every kernel launch's device time, in launch order (ncu replays each: slow, so 2 layers)
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    step bench_2layers 60 build/gpu_bench --layers 2 --steps 8
    step profile 300 $NCU --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
        --log-file "$LOG/ncu.csv" build/gpu_bench --layers 2 --steps 3
fi
if has kvbench; then
    step kvbench_cuda 120 build/kvserve bench -m $MODEL --device cuda -r 3
    step kvbench_cpu 120 build/kvserve bench -m $MODEL --device cpu -t 8 -r 1
fi
if has peer && [ ! -x $K/bin/llama-bench ]; then
    echo "== peer: no llama.cpp build: carry .gpu-peer (scripts/bench/build_llamacpp.sh" \
        "build/llamacpp cuda, then scripts/device/pack.sh)"
    status=1
elif has peer; then
    PEER_DEVICE=${PEER_DEVICE:-cuda} L=${PEER_LAYERS:-32}
    BIG=/tmp/kvpeer/llama3-8b-shape$([ "$L" = 32 ] || echo "-${L}layers").Q4_K.gguf
    # the CUDA runtime and cuBLAS where ldconfig lacks them: the toolkit's, or pip's
    if ldd $K/bin/llama-bench | grep -q "not found"; then
        CU=$(python3 -c 'import glob, nvidia; print(":".join(d for p in nvidia.__path__
            for d in glob.glob(p + "/*/lib")))' 2>/dev/null)
        export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/usr/local/cuda/lib64${CU:+:$CU}
    fi
    ldd $K/bin/llama-bench $K/bin/llama-server | grep "not found"
    python3 -c 'import gguf' 2>/dev/null || { python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --target /tmp/site .gpu-peer/whl/*.whl &&
        export PYTHONPATH=/tmp/site; }
    TOK=$([ -f $K/models/vocab.gguf ] && echo $K/models/vocab.gguf || echo $MODEL)
    mkdir -p /tmp/kvpeer && [ -s "$BIG" ] || step peer_model 120 bash -c "python3 \
        scripts/bench/make_bench_model.py --llama3-8b --layers $L --tokenizer-from $TOK \
        --out $BIG.part && mv $BIG.part $BIG"
    CUT=(); [ ! -f $MODEL ] || CUT=(-m $MODEL) # the 4-layer cut, where .gpu's call left it
    TAIL=40 step peer_bench 300 python3 scripts/bench/vs_llamacpp.py --device "$PEER_DEVICE" \
        --peer $K/bin/llama-bench "${CUT[@]}" -m "$BIG" -t 8 -r 3
    step peer_serve 240 python3 scripts/bench/serve.py --device "$PEER_DEVICE" --model "$BIG" \
        --llama-server $K/bin/llama-server --threads 8 --levels 1,32 --reps 2 --no-memory
fi
echo "device check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status

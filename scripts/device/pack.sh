#!/bin/sh
# Packs what a GPU device check needs into .gpu/ (git-ignored): the CUDA build's server, test and
# bench binaries (debug info stripped, symbols kept), the shared libraries they link beyond glibc
# and libstdc++ (the device image has no libmicrohttpd, jansson, Criterion, ...), and the default
# model cut to its first 4 layers (the whole one is over the device tool's 64 MiB a call, and a
# path one call carries is gone at the next). The llama.cpp peer too, where
# scripts/bench/build_llamacpp.sh's cuda level has built it into LLAMA: llama-bench, llama-server
# and their ggml/llama libraries (stripped; the CUDA runtime and cuBLAS stay behind: the device
# has them), and the `gguf` wheel that scripts/bench/make_bench_model.py needs there to write the
# Llama 3 8B shape file both engines run (4.3 GiB: it cannot be carried). Then, on the device:
# bash scripts/device/check.sh (the device tool's run with carry [".gpu"])
set -eu
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA=${LLAMA:-build/llamacpp/cuda/bin}
BINS="build/kvserve build/gpu_bench build/gpu-tests/cuda_test build/gpu-tests/cuda_forward_test build/gpu-tests/cuda_emu_test"
PEER="$LLAMA/llama-bench $LLAMA/llama-server"
make -j2 $BINS
[ -x "$LLAMA/llama-bench" ] && [ -x "$LLAMA/llama-server" ] || { PEER=; echo "pack: no llama.cpp" \
    "CUDA build in $LLAMA (scripts/bench/build_llamacpp.sh build/llamacpp cuda): no peer" >&2; }
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/models .gpu/whl
for b in $BINS; do strip --strip-debug -o .gpu/bin/$(basename $b) $b; done
for b in $PEER; do strip --strip-unneeded -o .gpu/bin/$(basename $b) $b; done
ldd $BINS $PEER | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s)\.so' |
    grep -Ev '/lib(cuda|cudart|cublas|cublasLt)\.so' |
    while read -r lib; do cp -L "$lib" .gpu/lib/; done
for l in .gpu/lib/*; do
    [ ! -e "$LLAMA/$(basename "$l")" ] || strip --strip-unneeded "$l"
done
[ -z "$PEER" ] || python3 -m pip download --quiet --no-deps --only-binary=:all: -d .gpu/whl \
    "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
python3 scripts/device/truncate_gguf.py "$MODEL" .gpu/models/$(basename "$MODEL") 4
tar cJf .gpu/pack.tar.xz -C .gpu bin lib && rm -rf .gpu/bin .gpu/lib
du -sh .gpu

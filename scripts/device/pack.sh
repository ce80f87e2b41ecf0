#!/bin/sh
# Packs what a GPU device check needs into .gpu/pack.tar.xz (git-ignored; xz -9, whose 64 MiB
# window finds what the binaries share): the CUDA build's server, test and bench binaries (debug
# info stripped, symbols kept), the shared libraries they link beyond glibc and libstdc++ (the
# device image has no libmicrohttpd, jansson, Criterion, ...), and the default model cut to its
# first 4 layers (the whole one is over the device tool's 64 MiB a call, and a path one call
# carries is gone at the next). The llama.cpp peer too, where scripts/bench/build_llamacpp.sh's
# cuda level has built it into LLAMA: llama-bench, llama-server and their ggml/llama libraries
# (stripped; the CUDA runtime and cuBLAS stay behind: the device has them), and the `gguf` wheel
# (.gpu/whl) that scripts/bench/make_bench_model.py needs there to write the Llama 3 8B shape
# file both engines run (4.3 GiB: it cannot be carried). STEPS=peer packs only what check.sh's
# peer step needs (kvserve, the peer, the model). Says how much of the 64 MiB .gpu and the working
# tree take. Then, on the device (the device tool's run, carry [".gpu"]):
#   bash scripts/device/check.sh          (or STEPS=peer bash scripts/device/check.sh)
set -eu
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA=${LLAMA:-build/llamacpp/cuda/bin}
T=build/gpu-tests
BINS="build/kvserve build/gpu_bench $T/cuda_test $T/cuda_forward_test $T/cuda_emu_test"
[ "${STEPS:-}" != peer ] || BINS=build/kvserve
PEER="$LLAMA/llama-bench $LLAMA/llama-server"
make -j2 $BINS
[ -x "$LLAMA/llama-bench" ] && [ -x "$LLAMA/llama-server" ] || { PEER=; echo "pack: no llama.cpp" \
    "CUDA build in $LLAMA (scripts/bench/build_llamacpp.sh build/llamacpp cuda): no peer" >&2; }
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/models .gpu/whl
for b in $BINS; do strip --strip-debug -o ".gpu/bin/$(basename $b)" $b; done
for b in $PEER; do strip --strip-unneeded -o ".gpu/bin/$(basename $b)" $b; done
ldd $BINS $PEER | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s)\.so' |
    grep -Ev '/lib(cuda|cudart|cublas|cublasLt)\.so' |
    while read -r lib; do cp -L "$lib" .gpu/lib/; done
for l in .gpu/lib/*; do
    [ ! -e "$LLAMA/$(basename "$l")" ] || strip --strip-unneeded "$l"
done
[ -z "$PEER" ] || python3 -m pip download --quiet --no-deps --only-binary=:all: -d .gpu/whl \
    "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
python3 scripts/device/truncate_gguf.py "$MODEL" ".gpu/models/$(basename "$MODEL")" 4
tar cf - -C .gpu bin lib models | xz -9 -T1 >.gpu/pack.tar.xz
rm -rf .gpu/bin .gpu/lib .gpu/models
tree=$(git ls-files -z -c -o --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
gpu=$(du -cb .gpu | tail -1 | cut -f1)
echo "pack: .gpu $((gpu >> 20)) MiB + the working tree $((tree >> 20)) MiB =" \
    "$(((gpu + tree) >> 20)) MiB of the device tool's 64"
[ $((gpu + tree)) -le $((64 << 20)) ] || { echo "pack: over 64 MiB" >&2; exit 1; }

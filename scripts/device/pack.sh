#!/bin/sh
# Packs what a GPU device check needs into .gpu/ (git-ignored through .git/info/exclude): the CUDA
# build's server, test and bench binaries (debug info stripped, symbols kept), the shared
# libraries they link beyond glibc and libstdc++ (the device image has no libmicrohttpd, jansson,
# Criterion, ...), and the default model cut to its first 4 layers (the whole one is over the
# device tool's 64 MiB a call, and a path one call carries is gone at the next). Then, on the
# device: bash scripts/device/check.sh
set -eu
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
BINS="build/kvserve build/gpu_bench build/gpu-tests/cuda_test build/gpu-tests/cuda_forward_test build/gpu-tests/cuda_emu_test"
make -j2 $BINS
mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/models
for b in $BINS; do strip --strip-debug -o .gpu/bin/$(basename $b) $b; done
ldd $BINS | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s)\.so' |
    while read -r lib; do cp -L "$lib" .gpu/lib/; done
python3 scripts/device/truncate_gguf.py "$MODEL" .gpu/models/$(basename "$MODEL") 4
tar cJf .gpu/pack.tar.xz -C .gpu bin lib && rm -rf .gpu/bin .gpu/lib
du -sh .gpu

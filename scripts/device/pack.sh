#!/bin/sh
# Packs what a GPU device check needs, xz -9 (its 64 MiB window finds what the binaries share),
# each pack within the device tool's 64 MiB a call together with the working tree (it says how
# much each takes; a path one call carries is gone at the next):
#   .gpu/pack.tar.xz       the CUDA build's server, test and bench binaries (debug info stripped,
#       symbols kept), the shared libraries they link beyond glibc and libstdc++ (the device image
#       has no libmicrohttpd, jansson, Criterion, ...), and the default model cut to its first 4
#       layers (the whole one is over the 64 MiB);
#   .gpu-peer/pack.tar.xz  where scripts/bench/build_llamacpp.sh's cuda level has built LLAMA:
#       kvserve, llama.cpp's llama-bench and llama-server with their ggml/llama libraries
#       (stripped; the CUDA runtime and cuBLAS stay behind: the device has them), the default
#       model's tokenizer alone (vocab.gguf), and .gpu-peer/whl, the `gguf` wheel that
#       scripts/bench/make_bench_model.py needs there to write the Llama 3 8B shape file both
#       engines run (4.3 GiB: it cannot be carried). The peer is 21.5 MiB packed: it does not
#       fit beside .gpu's, so it is a call of its own.
# Both are git-ignored. Then, on the device (the device tool's run):
#   bash scripts/device/check.sh                  carry [".gpu"]
#   STEPS=peer bash scripts/device/check.sh       carry [".gpu-peer"]
set -eu
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA=${LLAMA:-build/llamacpp/cuda/bin}
T=build/gpu-tests
BINS="build/kvserve build/gpu_bench $T/cuda_test $T/cuda_forward_test $T/cuda_emu_test"
PEER="$LLAMA/llama-bench $LLAMA/llama-server"
make -j2 $BINS

pack() { # pack DIR BINARY...: the binaries, their libraries and DIR/models into DIR/pack.tar.xz
    dir=$1; shift
    mkdir -p "$dir/bin" "$dir/lib"
    for b in "$@"; do
        case $b in "$LLAMA"/*) s=--strip-unneeded ;; *) s=--strip-debug ;; esac
        strip $s -o "$dir/bin/$(basename "$b")" "$b"
    done
    # LLAMA's libraries by their directory: the RUNPATH cmake wrote names the tree it was built
    # in, which may be gone (a worktree)
    LD_LIBRARY_PATH="$(realpath -m "$LLAMA")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$@" | awk '/=> \// {print $3}' | sort -u |
        grep -Ev '/(libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s)\.so' |
        grep -Ev '/lib(cuda|cudart|cublas|cublasLt)\.so' |
        while read -r lib; do cp -L "$lib" "$dir/lib/"; done
    for l in "$dir"/lib/*; do
        [ ! -e "$LLAMA/$(basename "$l")" ] || strip --strip-unneeded "$l"
    done
    tar cf - -C "$dir" bin lib models | xz -9 -T1 >"$dir/pack.tar.xz"
    rm -rf "${dir:?}/bin" "${dir:?}/lib" "${dir:?}/models"
    tree=$(git ls-files -z -c -o --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 |
        cut -f1)
    size=$(du -cb "$dir" | tail -1 | cut -f1)
    echo "pack: $dir $((size >> 20)) MiB + the working tree $((tree >> 20)) MiB =" \
        "$(((size + tree) >> 20)) MiB of the device tool's 64"
    [ $((size + tree)) -le $((64 << 20)) ] || { echo "pack: $dir is over 64 MiB" >&2; exit 1; }
}

rm -rf .gpu .gpu-peer && mkdir -p .gpu/models
python3 scripts/device/truncate_gguf.py "$MODEL" ".gpu/models/$(basename "$MODEL")" 4
pack .gpu $BINS
if [ -x "$LLAMA/llama-bench" ] && [ -x "$LLAMA/llama-server" ]; then
    mkdir -p .gpu-peer/models .gpu-peer/whl
    python3 scripts/device/truncate_gguf.py "$MODEL" .gpu-peer/models/vocab.gguf vocab
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d .gpu-peer/whl \
        "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    pack .gpu-peer build/kvserve $PEER
else
    echo "pack: no llama.cpp CUDA build in $LLAMA (scripts/bench/build_llamacpp.sh" \
        "build/llamacpp cuda): no .gpu-peer" >&2
fi

#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-server, the peers the benchmarks compare kvserve with,
# once per SIMD level, from the llama.cpp sources inside llama-cpp-python's source package on
# PyPI (the registry this project's machines reach). Nothing is committed: the builds go to
# DIR (default build/llamacpp), one folder per level:
#   DIR/avx2/bin/{llama-bench,llama-server}     GGML_NATIVE=OFF, AVX2 + FMA + F16C, no AVX-512
#   DIR/avx512/bin/{llama-bench,llama-server}   the same plus AVX-512 F/BW/DQ/VL and VNNI
#   DIR/cuda/bin/{llama-bench,llama-server}     avx2's CPU code plus the CUDA backend, built by
#       nvcc for one GPU architecture (CUDA_ARCH, default 90-real: the H200's sm_90 machine code
#       alone, no PTX), flash attention's vector kernels for an f16 cache only; ggml and llama
#       as shared libraries beside them in bin/ (one copy of the CUDA code for both), the CUDA
#       runtime and cuBLAS linked dynamically (the GPU machine has them); scripts/device/pack.sh
#       carries bin/ to it
# so that kvserve --simd avx2 / avx512 meets a peer built for the same instructions, whatever
# the build machine has, and kvserve --device cuda one built for the lent GPU. Idempotent: a
# level already built is skipped. The cuda level is not among the defaults: it needs nvcc and
# took 42 minutes on two cores shared with other work.
#
#   scripts/bench/build_llamacpp.sh [DIR] [LEVELS...]   (LEVELS: avx2 avx512 cuda; default the
#                                                        first two)
set -euo pipefail
dir=$(realpath -m "${1:-build/llamacpp}")
shift || true
levels=("$@")
[ ${#levels[@]} -gt 0 ] || levels=(avx2 avx512)
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${JOBS:-$(nproc)}

for p in cmake g++; do
    command -v "$p" >/dev/null || { echo "build_llamacpp: needs $p" >&2; exit 1; }
done

src="$dir/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$dir/src"
    echo "build_llamacpp: fetching llama-cpp-python $version's sources from PyPI"
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" \
        -d "$dir/src"
    tar xzf "$dir/src/llama_cpp_python-$version.tar.gz" -C "$dir/src"
fi

avx2=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
      -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF
      -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF)
for level in "${levels[@]}"; do
    shared=OFF
    case "$level" in
    avx2) simd=("${avx2[@]}") ;;
    avx512) simd=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
                  -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF
                  -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF) ;;
    cuda) command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
              { echo "build_llamacpp: the cuda level needs nvcc" >&2; exit 1; }
          simd=("${avx2[@]}" -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90-real}"
                -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF
                "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined") # libcuda.so.1: the
          shared=ON                                  # driver's, on the GPU machine alone
          command -v nvcc >/dev/null || simd+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc) ;;
    *) echo "build_llamacpp: unknown level '$level' (avx2, avx512, cuda)" >&2; exit 2 ;;
    esac
    out="$dir/$level"
    if [ -x "$out/bin/llama-bench" ] && [ -x "$out/bin/llama-server" ]; then
        echo "build_llamacpp: $level already built in $out"
        continue
    fi
    echo "build_llamacpp: building llama-bench and llama-server for $level in $out"
    cmake -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DGGML_CPU_REPACK=ON -DBUILD_SHARED_LIBS=$shared -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON "${simd[@]}" \
        >"$out.cmake.log" 2>&1 || { tail -20 "$out.cmake.log" >&2; exit 1; }
    cmake --build "$out" -j "$jobs" --target llama-bench llama-server >"$out.build.log" 2>&1 ||
        { tail -30 "$out.build.log" >&2; exit 1; }
done

# kvserve build. `make` builds build/kvserve; `make test` sets up, builds and runs every test;
# `make run` starts the HTTP server on the default model (http://127.0.0.1:8080/v1); `make test-asan` runs the tests under
# AddressSanitizer + UBSan.

CC      ?= gcc
BUILD   ?= build
MODEL   ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
# MODEL again at another quantization: the draft model of the --draft-model tests and bench
DRAFT_MODEL ?= models/SmolLM2-135M-Instruct.Q8_0.gguf
THREADS ?= 2
PYTHON  ?= python3
# Parallel jobs for the builds that `make test`, `make test-asan` and `make fuzz` start (the tests
# themselves run one at a time: their servers use every core)
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)

WARN    := -Wall -Wextra -Wshadow -Werror -Wno-psabi
OPT     ?= -O2 -g
# Baseline x86-64 for portable code; SIMD variants are compiled per file (below) and chosen at
# run time from CPUID, so one binary runs on any x86-64 and uses AVX2/AVX-512 where present.
CFLAGS  := -std=c11 $(OPT) $(WARN) -D_GNU_SOURCE -pthread -I. -fno-strict-aliasing $(EXTRA_CFLAGS)
BASE_LDLIBS := -lm -lpthread -lmicrohttpd -ljansson -lcrypto -luring -lhiredis -lexpat
LDLIBS  := $(BASE_LDLIBS)
AVX2_FLAGS   := -mavx2 -mfma -mf16c -mbmi2 -ffp-contract=fast
AVX512_FLAGS := $(AVX2_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni

LIB_SRC := $(sort $(wildcard util/*.c config/*.c kernels/*.c kernels/cpu/*.c model/*.c model/*/*.c cache/*.c cache/*/*.c) \
             $(filter-out server/cli/main.c,$(wildcard server/*.c server/*/*.c)))
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
# The web page's files (server/web/) go into the binary as byte arrays written by
# scripts/embed_assets.py into $(BUILD)/gen/: nothing is read or fetched at run time.
WEBUI_SRC := $(sort $(wildcard server/web/*))
LIB_OBJ += $(BUILD)/obj/gen/webui_assets.o

# The CUDA backend is built wherever nvcc is found (CUDA=0 leaves it out): device code for the
# A40 (sm_86) and H100 (sm_90), plus compute_90 PTX for newer GPUs to compile at load. Without it
# the build is the CPU build, and backend_cuda_create says why there is no CUDA.
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA ?= $(if $(NVCC),1,0)
ifeq ($(CUDA),1)
CUDA_HOME   ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH   ?= -gencode arch=compute_86,code=sm_86 -gencode arch=compute_90,code=sm_90 \
               -gencode arch=compute_90,code=compute_90
NVCC_FLAGS  := -std=c++17 -O2 -lineinfo $(CUDA_ARCH) -Werror all-warnings -I. \
               -Xcompiler "$(WARN) -D_GNU_SOURCE -pthread -fno-strict-aliasing"
LIB_OBJ     += $(patsubst %.cu,$(BUILD)/obj/%.cuda.o,$(sort $(wildcard kernels/cuda/*.cu)))
# static cudart: no library path to set at run time; cuBLAS is dlopened by the backend
LDLIBS      += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
$(BUILD)/obj/kernels/backend.o: CFLAGS += -DKVSERVE_CUDA
endif
# plain `make` builds the server (the stamp rule below would otherwise be the first target)
.DEFAULT_GOAL := all
# backend.o is rebuilt when CUDA changes (it holds the stub backend_cuda_create otherwise)
$(BUILD)/cuda-$(CUDA).stamp:
	@mkdir -p $(BUILD) && rm -f $(BUILD)/cuda-*.stamp && touch $@
$(BUILD)/obj/kernels/backend.o: $(BUILD)/cuda-$(CUDA).stamp
TEST_SRC := $(sort $(wildcard tests/unit/*_test.c))
TEST_CU_SRC := $(sort $(wildcard tests/unit/*_test.cu))
TEST_BIN := $(TEST_SRC:tests/unit/%.c=$(BUILD)/tests/%) $(TEST_CU_SRC:tests/unit/%.cu=$(BUILD)/tests/%)
TEST_HELPER_SRC := $(filter-out $(TEST_SRC),$(wildcard tests/unit/*.c))
TEST_HELPER_OBJ := $(TEST_HELPER_SRC:%.c=$(BUILD)/obj/%.o)

.PHONY: all run cluster test test-build gpu-build test-unit test-e2e test-asan test-gpu setup model fuzz clean format \
        format-check layout bench bench-serve bench-ttft bench-ttft-word bench-stream bench-levels bench-codec bench-blend \
        calibrate-reuse \
        bench-grammar bench-schema bench-gpu bench-spec bench-cluster
all: $(BUILD)/kvserve

$(BUILD)/obj/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX2_FLAGS) -MMD -MP -c $< -o $@
$(BUILD)/obj/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX512_FLAGS) -MMD -MP -c $< -o $@
$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/gen/webui_assets.c: $(WEBUI_SRC) scripts/embed_assets.py
	$(PYTHON) scripts/embed_assets.py -o $@ $(WEBUI_SRC)
$(BUILD)/obj/gen/webui_assets.o: $(BUILD)/gen/webui_assets.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/%.cuda.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libkvserve.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# In the sanitized build (make test-asan), the server that the end-to-end tests drive links the
# SIMD kernels (kernels/cpu/*_avx2.c, *_avx512.c) built without AddressSanitizer, UBSan still on:
# under ASan their dot tiles were three quarters of the server's time and 9x slower, and their
# memory safety is the unit tests' to check, which run them instrumented (build-asan/tests/:
# every type, tile shape and remainder at both levels). The objects given first define every
# symbol of the archive's instrumented copies, so those are not linked.
ifeq ($(SANITIZED),1)
KVSERVE_KERNEL_OBJ := $(patsubst %.c,$(BUILD)/obj-noasan/%.o,\
                        $(wildcard kernels/cpu/*_avx2.c kernels/cpu/*_avx512.c))
$(BUILD)/obj-noasan/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX2_FLAGS) -fno-sanitize=address -MMD -MP -c $< -o $@
$(BUILD)/obj-noasan/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX512_FLAGS) -fno-sanitize=address -MMD -MP -c $< -o $@
endif
$(BUILD)/kvserve: $(BUILD)/obj/server/cli/main.o $(KVSERVE_KERNEL_OBJ) $(BUILD)/libkvserve.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# ---------------------------------------------------------------- CUDA under emulation

# The CUDA backend's sources compiled as C++ against the emulator (kernels/cuda/emu.h): every
# kernel runs on the CPU in the unit tests, compared with the CPU backend. Tests only.
CXX      ?= g++
CXXFLAGS := -std=c++17 $(OPT) $(WARN) -D_GNU_SOURCE -pthread -I. -fno-strict-aliasing $(EXTRA_CFLAGS)
CUDA_SRC := $(sort $(wildcard kernels/cuda/*.cu))
EMU_OBJ  := $(CUDA_SRC:%.cu=$(BUILD)/obj/%.emu.o) $(BUILD)/obj/kernels/cuda/emu.o

$(BUILD)/obj/%.emu.o: %.cu
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -DKVSERVE_CUDA_EMU -x c++ -MMD -MP -c $< -o $@
$(BUILD)/obj/kernels/cuda/emu.o: kernels/cuda/emu.cc
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -DKVSERVE_CUDA_EMU -MMD -MP -c $< -o $@
$(BUILD)/libkvserve_emu.a: $(EMU_OBJ)
	@rm -f $@
	ar rcs $@ $^

TEST_LIBS := $(BUILD)/libkvserve_emu.a $(BUILD)/libkvserve.a
$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(TEST_HELPER_OBJ) $(TEST_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) -lcriterion -lstdc++
$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.emu.o $(TEST_HELPER_OBJ) $(TEST_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) -lcriterion -lstdc++

-include $(shell find $(BUILD)/obj $(BUILD)/obj-noasan -name '*.d' 2>/dev/null)

# ---------------------------------------------------------------- CUDA on a GPU

# test-gpu: the emulated comparisons (cuda_test, cuda_forward_test, cuda_emu_test) built against
# the device build (-DKVSERVE_TEST_GPU) and run on the GPU, then under compute-sanitizer's
# memcheck and racecheck. bench-gpu: scripts/bench/gpu_bench.c. Both skip, saying why, where
# there is no nvcc or no device.
GPU_TESTS := cuda_test cuda_forward_test cuda_emu_test
SANITIZER ?= $(or $(shell command -v compute-sanitizer 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/compute-sanitizer))
ifeq ($(CUDA),1)
GPU_TEST_BIN := $(GPU_TESTS:%=$(BUILD)/gpu-tests/%)
$(BUILD)/obj/gpu-tests/%.o: tests/unit/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DKVSERVE_TEST_GPU -MMD -MP -c $< -o $@
$(BUILD)/obj/gpu-tests/%.o: tests/unit/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -DKVSERVE_TEST_GPU -MMD -MP -c $< -o $@
$(BUILD)/gpu-tests/%: $(BUILD)/obj/gpu-tests/%.o $(TEST_HELPER_OBJ) $(BUILD)/libkvserve.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) -lcriterion
$(BUILD)/gpu_bench: $(BUILD)/obj/scripts/bench/gpu_bench.o $(BUILD)/libkvserve.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)
$(BUILD)/obj/scripts/bench/gpu_bench.o: CFLAGS += -I$(CUDA_HOME)/include

gpu-build: $(GPU_TEST_BIN) $(BUILD)/gpu_bench
test-gpu: $(MODEL)
	@$(MAKE) --no-print-directory -j$(JOBS) gpu-build
	@if ! $(BUILD)/gpu_bench --probe; then \
	    echo "test-gpu: SKIPPED: no usable CUDA device (the same comparisons ran under emulation in make test)"; \
	    exit 0; fi; \
	set -e; for t in $(GPU_TEST_BIN); do echo "== $$t"; $$t --jobs 1; done; \
	if [ -z "$(SANITIZER)" ]; then echo "test-gpu: compute-sanitizer not found: memcheck and racecheck SKIPPED"; exit 0; fi; \
	for tool in memcheck racecheck; do echo "== compute-sanitizer $$tool"; \
	    $(SANITIZER) --tool $$tool --target-processes all --error-exitcode 1 \
	        $(BUILD)/gpu-tests/cuda_test --jobs 1; done; \
	echo "== compute-sanitizer memcheck (forward pass)"; \
	$(SANITIZER) --tool memcheck --leak-check full --target-processes all --error-exitcode 1 \
	    $(BUILD)/gpu-tests/cuda_forward_test --jobs 1 --filter 'cuda_forward/tiny*'

bench-gpu:
	@$(MAKE) --no-print-directory -j$(JOBS) $(BUILD)/gpu_bench
	@if $(BUILD)/gpu_bench --probe; then $(BUILD)/gpu_bench; \
	else echo "bench-gpu: SKIPPED: no usable CUDA device"; fi
else
test-gpu bench-gpu gpu-build:
	@echo "$@: SKIPPED: kvserve is built without CUDA (no nvcc found, or CUDA=0)"
endif

# ---------------------------------------------------------------- set-up

setup:
	@bash scripts/setup.sh

$(MODEL):
	@bash scripts/fetch-model.sh $(MODEL)
# The default model's reuse-quality calibration ships with the repository (scripts/quality/;
# regenerate it with `make calibrate-reuse`): it goes beside the model, where the server looks,
# unless a calibration is there already (your own `make calibrate-reuse` is kept).
SHIPPED_QUALITY := $(wildcard scripts/quality/$(notdir $(MODEL)).kvquality.json)
QUALITY := $(if $(SHIPPED_QUALITY),$(MODEL).kvquality.json)
$(MODEL).kvquality.json: | $(MODEL)
	@if [ -n "$(SHIPPED_QUALITY)" ] && [ ! -f $@ ]; then cp $(SHIPPED_QUALITY) $@; fi
model: $(MODEL) $(QUALITY) $(DRAFT_MODEL)
# The default model requantized (scripts/make_draft_model.py, deterministic; seconds): written
# beside it for the tests, which find it at this path.
$(DRAFT_MODEL): scripts/make_draft_model.py | setup $(MODEL)
	$(PYTHON) scripts/make_draft_model.py $(MODEL) $@

# ---------------------------------------------------------------- run

# Extra `kvserve serve` options: make run ARGS="--port 9000 --api-key secret"
ARGS ?=
run: setup $(MODEL) $(QUALITY) $(BUILD)/kvserve
	$(BUILD)/kvserve serve -m $(MODEL) -t $(THREADS) $(ARGS)

# A local cluster (scripts/cluster.py): INSTANCES instances on CLUSTER_THREADS threads each behind
# sglang-router (ROUTER=vllm for vLLM's, POLICY=round_robin|power_of_two), sharing a Redis tier of
# SHARDS redis-server shards behind nutcracker; the router on CLUSTER_PORT; Ctrl-C stops it all. ARGS go
# to every instance.
INSTANCES ?= 2
SHARDS ?= 2
POLICY ?= cache_aware
ROUTER ?= sglang
CLUSTER_THREADS ?= 1
CLUSTER_PORT ?= 8080
cluster: setup $(MODEL) $(QUALITY) $(BUILD)/kvserve
	$(PYTHON) scripts/cluster.py --bin $(BUILD)/kvserve --model $(MODEL) --instances $(INSTANCES) \
	    --shards $(SHARDS) --policy $(POLICY) --router $(ROUTER) --threads $(CLUSTER_THREADS) \
	    --port $(CLUSTER_PORT) -- $(ARGS)

bench: $(MODEL) $(BUILD)/kvserve
	$(BUILD)/kvserve bench -m $(MODEL) -t $(THREADS)

# Aggregate decode throughput of the server at 1, 4 and 16 concurrent streams.
bench-serve: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/serve.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# Time to first token: cold vs pool, RAM and disk hits of the context cache at 1K/4K/8K tokens.
bench-ttft: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/ttft.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# Time to first token at low load, prompts sharing all but their last word (6, 200 and 3,000
# tokens), kvserve against llama-server (scripts/bench/build_llamacpp.sh builds it) in one run.
LLAMA_SERVER ?= build/llamacpp/avx512/bin/llama-server
bench-ttft-word: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/ttft_word.py --bin $(BUILD)/kvserve --model $(MODEL) \
	    --threads $(THREADS) --llama-server $(LLAMA_SERVER)

# A multi-tenant RAG load (32 documents, Zipf, 8 clients) against one instance and two behind
# sglang-router (round_robin, cache_aware) sharing one Redis tier: cached share by tier, TTFT, req/s.
bench-cluster: setup $(MODEL) $(QUALITY) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/cluster.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# KV over the network: TTFT of a 4K-token context whose KV is in a Redis behind a link shaped
# with tc (50 Mbps to 3 Gbps, in a network namespace: needs root, else SKIPPED), per level, text
# recompute and adaptive, with each level's quality against exact KV.
bench-stream: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/stream.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# The local tiers holding encodings: RAM (--cache-ram-encoding) and disk (--cache-disk-encoded),
# per encoding: room, TTFT and answers against a full prefill.
bench-levels: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/levels.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# CacheBlend on a RAG set from local texts: quality against full prefill and TTFT per selection
# policy and ratio, beside the noise floor, the server's default, and the frontier drawn.
bench-blend: $(MODEL) $(QUALITY) $(BUILD)/kvserve
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install --quiet matplotlib
	$(PYTHON) scripts/bench/blend.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS) \
	    --plot $(BUILD)/blend-frontier.png

# Approximate reuse's quality on MODEL (every blend policy over a sweep of ratios, against full
# prefill and the noise floor): writes MODEL.kvquality.json, which the server's
# --reuse-quality budget picks from. CALIBRATE_ARGS="--prompts FILE.jsonl" for your own prompts.
CALIBRATE_ARGS ?=
calibrate-reuse: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/calibrate_reuse.py --bin $(BUILD)/kvserve --model $(MODEL) \
	    --threads $(THREADS) $(CALIBRATE_ARGS)

# Prompt Cache: TTFT with a schema's modules reused vs full prefill at 1K/4K/8K tokens of
# modules, and the answers' quality (plain and with the fix-up) against full prefill.
# Speculation from the context: decode tokens/s off and on (RAG, free chat, an edit with a
# prediction, concurrent streams), acceptance and greedy mismatches (scripts/bench/spec.py);
# beside llama-server's context speculation when scripts/bench/build_llamacpp.sh has built it.
LLAMA_SERVER ?= $(wildcard $(BUILD)/llamacpp/avx512/bin/llama-server)
# BENCH_DRAFT=1 adds a row set with the draft model (DRAFT_MODEL, drafting for MODEL).
BENCH_DRAFT ?=
bench-spec: $(MODEL) $(BUILD)/kvserve $(if $(BENCH_DRAFT),$(DRAFT_MODEL))
	$(PYTHON) scripts/bench/spec.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS) \
	    $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) \
	    $(if $(BENCH_DRAFT),--draft-model $(DRAFT_MODEL))

bench-schema: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/schema.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# The CacheGen codec: bytes/token, speed and quality of every level and baseline (codec-eval).
bench-codec: $(MODEL) $(BUILD)/kvserve
	$(PYTHON) scripts/bench/codec.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# The quantized dot-tile microbenchmark (scripts/bench/quant_bench.c): GMAC/s per type and tile.
QUANT_BENCH_OBJ := $(addprefix $(BUILD)/obj/,kernels/cpu/quant.o kernels/cpu/quant_avx2.o \
                     kernels/cpu/quant_avx512.o kernels/quant_traits.o util/util.o)
$(BUILD)/quant_bench: $(BUILD)/obj/scripts/bench/quant_bench.o $(QUANT_BENCH_OBJ)
	$(CC) $(CFLAGS) $^ -o $@ -lm -lcrypto

# Constrained decoding's mask time per token on the model's vocabulary (grammar_bench.c), and
# the server's time per token under a schema vs free text, with and without jump-forward.
$(BUILD)/grammar_bench: $(BUILD)/obj/scripts/bench/grammar_bench.o $(BUILD)/libkvserve.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)
bench-grammar: $(MODEL) $(BUILD)/kvserve $(BUILD)/grammar_bench
	$(BUILD)/grammar_bench $(MODEL)
	$(PYTHON) scripts/bench/structured.py --bin $(BUILD)/kvserve --model $(MODEL) --threads $(THREADS)

# ---------------------------------------------------------------- tests

# The build first, JOBS at a time; then the unit and end-to-end tests one after the other.
test: setup $(MODEL) $(QUALITY) $(DRAFT_MODEL)
	$(MAKE) --no-print-directory -j$(JOBS) test-build
	$(MAKE) --no-print-directory test-unit test-e2e

test-build: $(TEST_BIN) $(BUILD)/kvserve

test-unit: $(TEST_BIN) $(BUILD)/kvserve $(DRAFT_MODEL)
	@set -e; for t in $(TEST_BIN); do echo "== $$t"; $$t --jobs 1; done
	$(PYTHON) scripts/layout.py --check README.md --calls $(BUILD)/obj --functions

# README's picture of the folders (which includes which), from the #include lines.
layout:
	$(PYTHON) scripts/layout.py --write README.md

test-e2e: $(BUILD)/kvserve $(DRAFT_MODEL)
	KVSERVE_BIN=$(BUILD)/kvserve KVSERVE_TEST_MODEL=$(MODEL) KVSERVE_SANITIZED=$(SANITIZED) \
	    KVSERVE_TEST_DRAFT_MODEL=$(DRAFT_MODEL) \
	    $(PYTHON) -m pytest -q -rs tests/e2e

# The same unit and end-to-end tests, built with AddressSanitizer and UBSan in build-asan/, at -O2
# as the release build (the checks are the same at any level; the model's compute under them ran
# 1.6x faster than at -O1: model_test 39 s against 64 s).
ASAN_FLAGS := -O2 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
# The CUDA backend's host code is left out (CUDA=0): its kernels are covered under the sanitizers
# by the emulated build the unit tests use (device memory is then malloc'd: ASan checks bounds).
ASAN_MAKE = $(MAKE) --no-print-directory BUILD=build-asan OPT="$(ASAN_FLAGS)" SANITIZED=1 CUDA=0 \
	    LDLIBS="$(BASE_LDLIBS) -fsanitize=address,undefined"
test-asan: setup $(MODEL) $(QUALITY) $(DRAFT_MODEL)
	$(ASAN_MAKE) -j$(JOBS) test-build
	$(ASAN_MAKE) test-unit test-e2e

# ---------------------------------------------------------------- fuzzing (clang + libFuzzer)

FUZZ_SRC := $(wildcard tests/fuzz/*_fuzz.c)
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=build-fuzz/%)
FUZZ_SECONDS ?= 30
# Each target links only the sources it exercises (FUZZ_DEPS_<target>): the parsers are plain C,
# while the SIMD kernels use _Float16, which clang 14 does not support on x86. UBSan findings
# abort (no-recover), so libFuzzer counts them as crashes and saves the input.
FUZZ_DEPS_COMMON := util/util.c util/json.c util/utf8.c kernels/quant_traits.c
FUZZ_DEPS_grammar_fuzz := model/grammar/grammar.c model/grammar/grammar_match.c \
    model/grammar/json_schema.c
FUZZ_DEPS_gguf_fuzz := model/gguf.c
FUZZ_DEPS_tokenizer_fuzz := model/gguf.c $(wildcard model/tokenizer/*.c)
FUZZ_DEPS_api_fuzz := server/api/api.c server/http/error.c model/sampler.c cache/chunk.c \
    cache/blend/blend_policy.c model/chat/chat.c model/chat/chat_tools.c model/chat/chat_json.c \
    $(FUZZ_DEPS_grammar_fuzz)
FUZZ_DEPS_responses_fuzz := server/api/responses_parse.c $(FUZZ_DEPS_api_fuzz)
FUZZ_DEPS_chat_tools_fuzz := model/chat/chat.c model/chat/chat_tools.c model/chat/chat_json.c \
    $(FUZZ_DEPS_grammar_fuzz)
FUZZ_DEPS_rans_fuzz := cache/codec/rans.c
FUZZ_DEPS_record_fuzz := cache/store/record.c cache/chunk.c
FUZZ_DEPS_redis_url_fuzz := cache/store/redis_url.c
FUZZ_DEPS_redis_envelope_fuzz := cache/store/redis_envelope.c
FUZZ_DEPS_pml_fuzz := cache/schema/pml.c
FUZZ_DEPS_content_disk_fuzz := cache/store/content_disk.c cache/store/dirstore.c \
    cache/store/content.c cache/chunk.c util/keytable.c
FUZZ_DEPS_codec_fuzz := cache/codec/codec.c cache/codec/codec_quant.c cache/codec/rans.c kernels/rope.c
FUZZ_DEPS_quality_fuzz := cache/quality.c cache/blend/blend_policy.c cache/chunk.c
FUZZ_DEPS_anthropic_fuzz := server/api/anthropic_req.c $(FUZZ_DEPS_api_fuzz)
FUZZ_DEPS_leases_fuzz := cache/store/leases.c
FUZZ_DEPS_browser_fuzz := server/http/browser.c
.SECONDEXPANSION:
build-fuzz/%: tests/fuzz/%.c $(FUZZ_DEPS_COMMON) $$(FUZZ_DEPS_$$*)
	@mkdir -p build-fuzz
	clang -std=c11 -O1 -g -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined \
	    -fno-sanitize-recover=undefined $< $(FUZZ_DEPS_COMMON) $(FUZZ_DEPS_$*) -o $@ $(LDLIBS)
# The seed corpus tests/fuzz/corpus/<target>/ is optional: libFuzzer exits with an error when
# given a directory that does not exist.
# The targets are built JOBS at a time, then run JOBS at a time (each FUZZ_SECONDS on one core);
# each one's log is printed whole when it ends, and any failure fails the run.
fuzz:
	@$(MAKE) --no-print-directory -j$(JOBS) $(FUZZ_BIN)
	@printf '%s\n' $(FUZZ_BIN) | xargs -P $(JOBS) -I{} sh -c 'n=$$(basename {}); \
	  mkdir -p build-fuzz/corpus-$$n; seeds=tests/fuzz/corpus/$$n; [ -d $$seeds ] || seeds=; \
	  {} -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 build-fuzz/corpus-$$n $$seeds \
	    >build-fuzz/$$n.log 2>&1; rc=$$?; \
	  echo "== $$n ($(FUZZ_SECONDS)s): exit $$rc"; cat build-fuzz/$$n.log; exit $$(( rc != 0 ))' 

# ---------------------------------------------------------------- style

FORMAT_SRC = $(shell git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cc')
format:
	clang-format -i $(FORMAT_SRC)
format-check:
	clang-format --dry-run --Werror $(FORMAT_SRC)

clean:
	rm -rf build build-asan build-fuzz

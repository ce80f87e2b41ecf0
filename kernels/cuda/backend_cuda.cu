/* The CUDA backend: lifetime, memory, streams, the matmul dispatch (int8 or f32 GEMV kernels, int8
 * tensor-core tiles, or dequantized tiles through cuBLAS) and the KV pool's host-facing copies;
 * the kernels are in mmvq.cu, mmq.cu, matmul.cu, ops.cu and attention.cu. Built twice: by nvcc for
 * the device (backend_cuda_create), and by g++ against the emulator for the tests
 * (backend_cuda_emu_create).
 *
 * Memory: weights are uploaded once in their GGUF types (backend_weight_data, shared by every
 * forward context); scratch is reserved by backend_reserve; ops allocate nothing. Every op is
 * queued on the compute stream. Host-facing KV transfers (kv_store, kv_load, the synchronous
 * block copies) run on their own stream behind an event of the compute stream, through pinned
 * staging, and return when done; the async block copies run on the caller's stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"

#ifndef KVSERVE_CUDA_EMU
#include <dlfcn.h>
#endif

namespace KV_CUDA_NS {

/* Dequantized weight rows per GEMM tile (f16; f32 for F32/BF16 weights takes twice the bytes). */
#define WTILE_BYTES (32u << 20)

extern const backend_ops cuda_ops;          /* the table, at the end */
static void graphs_clear(cuda_backend *cb); /* step graphs, below */

/* ---------------------------------------------------------------- cuBLAS */

#ifdef KVSERVE_CUDA_EMU
static int blas_load(cublas_api *a, kv_error *err) {
    (void)err;
    *a = cublas_api{nullptr, cublasCreate, cublasDestroy, cublasSetStream, nullptr, cublasGemmEx};
    return 0;
}
static void blas_unload(cublas_api *a) { (void)a; }
#else
#define KV_STR2(x) #x
#define KV_STR(x) KV_STR2(x)
static int blas_load(cublas_api *a, kv_error *err) {
    const char *names[] = {"libcublas.so." KV_STR(CUBLAS_VER_MAJOR), "libcublas.so"};
    for (const char *n : names)
        if ((a->lib = dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    if (!a->lib)
        return kv_fail(err, "cannot load cuBLAS (libcublas.so.%d): %s", CUBLAS_VER_MAJOR,
                       dlerror());
    a->create = reinterpret_cast<decltype(a->create)>(dlsym(a->lib, "cublasCreate_v2"));
    a->destroy = reinterpret_cast<decltype(a->destroy)>(dlsym(a->lib, "cublasDestroy_v2"));
    a->set_stream = reinterpret_cast<decltype(a->set_stream)>(dlsym(a->lib, "cublasSetStream_v2"));
    a->gemm_ex = reinterpret_cast<decltype(a->gemm_ex)>(dlsym(a->lib, "cublasGemmEx"));
    a->set_workspace =
        reinterpret_cast<decltype(a->set_workspace)>(dlsym(a->lib, "cublasSetWorkspace_v2"));
    if (!a->create || !a->destroy || !a->set_stream || !a->gemm_ex) {
        dlclose(a->lib);
        a->lib = nullptr;
        return kv_fail(err, "cuBLAS lacks cublasCreate_v2/cublasGemmEx");
    }
    return 0;
}
static void blas_unload(cublas_api *a) {
    if (a->lib) dlclose(a->lib);
    a->lib = nullptr;
}
#endif

#define BLAS_CHECK(call)                                                                           \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            log_error("cuda: %s: cuBLAS status %d", #call, (int)s_);                               \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------- lifetime */

/* Confirms the device runs this build's kernels (sm_86/sm_90 code, compute_90 PTX). */
__global__ void kernel_probe(int *p) {
    if (p) *p = 1;
}

static void cuda_destroy(backend *b) {
    cuda_backend *cb = cuda_of(b);
    if (cb->compute) cudaStreamSynchronize(cb->compute);
    if (cb->xfer) cudaStreamSynchronize(cb->xfer);
    graphs_clear(cb);
    for (int i = 0; i < cb->n_weights; i++) cudaFree(cb->weights[i].dev);
    free(cb->weights);
    cudaFree(cb->x16);
    cudaFree(cb->xq);
    cudaFree(cb->xd);
    cudaFree(cb->wtile);
    cudaFree(cb->part);
    cudaFree(cb->desc);
    free(cb->hdesc);
    cudaFree(cb->xfer_dev);
    cudaFreeHost(cb->xfer_host);
    cudaFreeHost(cb->up_host);
    for (int i = 0; i < UPLOAD_SLOTS; i++)
        if (cb->up_done[i]) cudaEventDestroy(cb->up_done[i]);
    if (cb->xfer_after) cudaEventDestroy(cb->xfer_after);
    if (cb->handle) cb->blas.destroy(cb->handle);
    cudaFree(cb->blas_ws);
    blas_unload(&cb->blas);
    if (cb->xfer) cudaStreamDestroy(cb->xfer);
    if (cb->compute) cudaStreamDestroy(cb->compute);
    pthread_mutex_destroy(&cb->mu);
    pthread_mutex_destroy(&cb->xfer_mu);
    free(cb);
}

#define CREATE_CHECK(call)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            kv_fail(err, "cuda: %s: %s", #call, cudaGetErrorString(e_));                           \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

static backend *create(kv_error *err, bool emulated) {
    int n = 0;
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        kv_fail(err, "no CUDA device (%s)",
                e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        cudaGetLastError();
        return nullptr;
    }
    cuda_backend *cb = static_cast<cuda_backend *>(calloc(1, sizeof *cb));
    if (!cb) {
        kv_fail(err, "out of memory creating the CUDA backend");
        return nullptr;
    }
    cb->base.ops = &cuda_ops;
    cb->base.host_memory = false;
    cb->emulated = emulated;
    cb->graphs_on = true;
    pthread_mutex_init(&cb->mu, nullptr);
    pthread_mutex_init(&cb->xfer_mu, nullptr);
    CREATE_CHECK(cudaSetDevice(0));
    CREATE_CHECK(cudaGetDeviceProperties(&prop, 0));
    snprintf(cb->device, sizeof cb->device, "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major,
             prop.minor, (double)prop.totalGlobalMem / (1 << 30));
    KV_LAUNCH(kernel_probe, dim3(1), dim3(32), 0, 0, (int *)nullptr);
    if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
        kv_fail(err, "CUDA device %s cannot run kvserve's kernels (built for sm_86 and sm_90): %s",
                cb->device, cudaGetErrorString(e));
        goto fail;
    }
    CREATE_CHECK(cudaStreamCreateWithFlags(&cb->compute, cudaStreamNonBlocking));
    CREATE_CHECK(cudaStreamCreateWithFlags(&cb->xfer, cudaStreamNonBlocking));
    CREATE_CHECK(cudaEventCreateWithFlags(&cb->xfer_after, cudaEventDisableTiming));
    for (int i = 0; i < UPLOAD_SLOTS; i++)
        CREATE_CHECK(cudaEventCreateWithFlags(&cb->up_done[i], cudaEventDisableTiming));
    CREATE_CHECK(cudaHostAlloc((void **)&cb->up_host, (size_t)UPLOAD_SLOTS * UPLOAD_SLOT_BYTES,
                               cudaHostAllocDefault));
    CREATE_CHECK(cudaHostAlloc((void **)&cb->xfer_host, XFER_BYTES, cudaHostAllocDefault));
    CREATE_CHECK(cudaMalloc((void **)&cb->xfer_dev, XFER_BYTES));
    if (blas_load(&cb->blas, err)) goto fail;
    if (cb->blas.set_workspace) CREATE_CHECK(cudaMalloc(&cb->blas_ws, BLAS_WORKSPACE));
    if (cb->blas.create(&cb->handle) != CUBLAS_STATUS_SUCCESS ||
        cb->blas.set_stream(cb->handle, cb->compute) != CUBLAS_STATUS_SUCCESS ||
        (cb->blas.set_workspace &&
         cb->blas.set_workspace(cb->handle, cb->blas_ws, BLAS_WORKSPACE) !=
             CUBLAS_STATUS_SUCCESS)) {
        cb->handle = nullptr;
        kv_fail(err, "cuBLAS cannot start on %s", cb->device);
        goto fail;
    }
    log_info("cuda backend: %s%s", cb->device, emulated ? ", emulated on the CPU" : "");
    return &cb->base;
fail:
    cudaGetLastError();
    cuda_destroy(&cb->base);
    return nullptr;
}

static const char *cuda_name(const backend *b) {
    return reinterpret_cast<const cuda_backend *>(b)->emulated ? "cuda-emu" : "cuda";
}

static int cuda_n_threads(const backend *b) {
    (void)b;
    return 1;
}

static void cuda_set_precision(backend *b, matmul_precision p) { cuda_of(b)->precision = p; }

/* Grows a device buffer to at least `bytes` (after the device is idle: queued ops may use it;
 * recorded steps that read the old one go). */
static int grow(cuda_backend *cb, void **p, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return 0;
    CUDA_CHECK(cudaDeviceSynchronize());
    graphs_clear(cb);
    cudaFree(*p);
    *p = nullptr;
    *cap = 0;
    CUDA_CHECK(cudaMalloc(p, bytes));
    *cap = bytes;
    return 0;
}

static int cuda_reserve(backend *b, const backend_limits *lim, kv_error *err) {
    cuda_backend *cb = cuda_of(b);
    size_t cap;
    /* int8 activation codes: mmvq's rows, and mmq's for the largest batch */
    const size_t nq =
        (size_t)(lim->max_tokens > MMVQ_MAX_TOKENS ? lim->max_tokens : MMVQ_MAX_TOKENS) *
        (size_t)lim->max_n_in;
    if (lim->max_tokens > GEMV_MAX_TOKENS) {
        cap = cb->x16_elems * 2;
        if (grow(cb, (void **)&cb->x16, &cap, (size_t)lim->max_tokens * lim->max_n_in * 2))
            goto oom;
        cb->x16_elems = cap / 2;
        size_t tile = (size_t)64 * lim->max_n_in * 4;
        if (grow(cb, &cb->wtile, &cb->wtile_bytes, tile > WTILE_BYTES ? tile : WTILE_BYTES))
            goto oom;
    }
    if (nq > cb->xq_elems) {
        cap = cb->xq_elems;
        size_t cap_d = cap / 32 * sizeof(q8_ds);
        cb->xq_elems = 0; /* until both have grown */
        if (grow(cb, (void **)&cb->xq, &cap, nq) ||
            grow(cb, (void **)&cb->xd, &cap_d, nq / 32 * sizeof(q8_ds)))
            goto oom;
        cb->xq_elems = nq;
    }
    if (lim->n_head > 0 && lim->head_dim > 0) {
        cap = cb->part_floats * 4;
        size_t parts = (size_t)lim->max_seqs * ATTN_SPLIT_ROWS * lim->n_head * ATTN_MAX_SPLIT *
                       (lim->head_dim + 2);
        if (grow(cb, (void **)&cb->part, &cap, parts * 4)) goto oom;
        cb->part_floats = cap / 4;
    }
    if (lim->max_seqs > cb->desc_cap) {
        cap = (size_t)cb->desc_cap * sizeof(attn_desc);
        if (grow(cb, (void **)&cb->desc, &cap, (size_t)lim->max_seqs * sizeof(attn_desc))) goto oom;
        attn_desc *h = static_cast<attn_desc *>(realloc(cb->hdesc, cap));
        if (!h) goto oom;
        cb->hdesc = h;
        cb->desc_cap = lim->max_seqs;
    }
    return 0;
oom:
    return kv_fail(err, "cuda: out of device memory reserving scratch for %d tokens",
                   lim->max_tokens);
}

/* ---------------------------------------------------------------- memory */

static void *cuda_alloc(backend *b, size_t bytes) {
    (void)b;
    void *p = nullptr;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        log_error("cuda: out of device memory (%zu bytes)", bytes);
        return nullptr;
    }
    return p;
}

static void cuda_free(backend *b, void *p) {
    /* queued ops may still use it */
    cudaStreamSynchronize(cuda_of(b)->compute);
    cudaFree(p);
}

static const void *cuda_weight_data(backend *b, const void *host, size_t bytes, kv_error *err) {
    cuda_backend *cb = cuda_of(b);
    void *dev = nullptr;
    pthread_mutex_lock(&cb->mu);
    for (int i = 0; i < cb->n_weights; i++)
        if (cb->weights[i].host == host && cb->weights[i].bytes >= bytes) {
            dev = cb->weights[i].dev;
            cb->weights[i].refs++;
            goto done;
        }
    if (cb->n_weights == cb->cap_weights) {
        int cap = cb->cap_weights ? 2 * cb->cap_weights : 64;
        weight_copy *w = static_cast<weight_copy *>(realloc(cb->weights, sizeof *w * cap));
        if (!w) goto done;
        cb->weights = w;
        cb->cap_weights = cap;
    }
    if (cudaMalloc(&dev, bytes) != cudaSuccess) {
        dev = nullptr;
        goto done;
    }
    if (cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaFree(dev);
        dev = nullptr;
        goto done;
    }
    cb->weights[cb->n_weights++] = weight_copy{host, bytes, dev, 1};
done:
    pthread_mutex_unlock(&cb->mu);
    if (!dev) {
        cudaGetLastError();
        kv_fail(err, "cuda: cannot upload %zu bytes of weights (out of device memory?)", bytes);
    }
    return dev;
}

static void cuda_weight_release(backend *b, const void *host) {
    cuda_backend *cb = cuda_of(b);
    pthread_mutex_lock(&cb->mu);
    for (int i = 0; i < cb->n_weights; i++)
        if (cb->weights[i].host == host) {
            if (--cb->weights[i].refs == 0) {
                cudaStreamSynchronize(cb->compute); /* queued ops may read it */
                cudaFree(cb->weights[i].dev);
                cb->weights[i] = cb->weights[--cb->n_weights];
            }
            break;
        }
    pthread_mutex_unlock(&cb->mu);
}

int cuda_upload(cuda_backend *cb, void *dst, const void *src, size_t bytes, cudaStream_t s) {
    if (cb->recording && pthread_equal(cb->recorder, pthread_self())) {
        /* a replay would copy whatever the slot holds by then */
        log_error("cuda: a host upload inside a recorded step (backend_graph_begin)");
        cb->record_failed = true;
        return -1;
    }
    if (bytes > UPLOAD_SLOT_BYTES) {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaStreamSynchronize(s)); /* the host may reuse src at once */
        return 0;
    }
    pthread_mutex_lock(&cb->mu);
    int i = cb->up_next;
    cb->up_next = (i + 1) % UPLOAD_SLOTS;
    unsigned char *slot = cb->up_host + (size_t)i * UPLOAD_SLOT_BYTES;
    cudaError_t e = cudaEventSynchronize(cb->up_done[i]); /* its last copy has read it */
    if (e == cudaSuccess) {
        memcpy(slot, src, bytes);
        e = cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, s);
    }
    if (e == cudaSuccess) e = cudaEventRecord(cb->up_done[i], s);
    pthread_mutex_unlock(&cb->mu);
    CUDA_CHECK(e);
    return 0;
}

static int cuda_upload_op(backend *b, void *dst, const void *src, size_t bytes) {
    return cuda_upload(cuda_of(b), dst, src, bytes, cuda_of(b)->compute);
}

static int cuda_download(backend *b, void *dst, const void *src, size_t bytes) {
    cuda_backend *cb = cuda_of(b);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->compute));
    CUDA_CHECK(cudaStreamSynchronize(cb->compute));
    return 0;
}

static int cuda_sync(backend *b) {
    (void)b;
    CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
}

static void *cuda_host_alloc(backend *b, size_t bytes) {
    (void)b;
    void *p = nullptr;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return p;
}

static void cuda_host_free(backend *b, void *p) {
    (void)b;
    cudaFreeHost(p);
}

/* Streams and events are the runtime's handles, cast. */
static cudaStream_t stream_of(cuda_backend *cb, backend_stream *s) {
    return s ? reinterpret_cast<cudaStream_t>(s) : cb->compute;
}

static backend_stream *cuda_stream_create(backend *b, kv_error *err) {
    (void)b;
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        cudaGetLastError();
        kv_fail(err, "cuda: cannot create a stream");
        return nullptr;
    }
    return reinterpret_cast<backend_stream *>(s);
}

static void cuda_stream_destroy(backend *b, backend_stream *s) {
    (void)b;
    cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s));
}

static backend_event *cuda_event_create(backend *b, kv_error *err) {
    (void)b;
    cudaEvent_t e;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        kv_fail(err, "cuda: cannot create an event");
        return nullptr;
    }
    return reinterpret_cast<backend_event *>(e);
}

static void cuda_event_destroy(backend *b, backend_event *e) {
    (void)b;
    cudaEventDestroy(reinterpret_cast<cudaEvent_t>(e));
}

static int cuda_event_record(backend *b, backend_event *e, backend_stream *s) {
    CUDA_CHECK(cudaEventRecord(reinterpret_cast<cudaEvent_t>(e), stream_of(cuda_of(b), s)));
    return 0;
}

static int cuda_stream_wait(backend *b, backend_stream *s, backend_event *e) {
    CUDA_CHECK(cudaStreamWaitEvent(stream_of(cuda_of(b), s), reinterpret_cast<cudaEvent_t>(e), 0));
    return 0;
}

static int cuda_event_sync(backend *b, backend_event *e) {
    (void)b;
    CUDA_CHECK(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(e)));
    return 0;
}

/* ---------------------------------------------------------------- matmul */

/* y = x W^T through cuBLAS (column-major: C[n_out x n_tok] = W[n_in x n_out]^T X[n_in x n_tok]):
 * F16 weights as they are, F32 ones in f32, others dequantized tile by tile (f16; f32 for BF16,
 * whose range f16 lacks). Tensor cores take the f16 products; sums are f32. */
static int gemm(cuda_backend *cb, const weight *w, const float *x, const uint16_t *x16, int n_tok,
                float *y) {
    const float one = 1.0f, zero = 0.0f;
    const int n_in = (int)w->n_in, n_out = (int)w->n_out;
    if (w->type == TENSOR_TYPE_F16 || w->type == TENSOR_TYPE_F32) {
        const bool f32 = w->type == TENSOR_TYPE_F32;
        const cudaDataType t = f32 ? CUDA_R_32F : CUDA_R_16F;
        BLAS_CHECK(cb->blas.gemm_ex(cb->handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tok, n_in, &one,
                                    w->data, t, (int)(w->row_bytes / (f32 ? 4 : 2)),
                                    f32 ? static_cast<const void *>(x) : x16, t, n_in, &zero, y,
                                    CUDA_R_32F, n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return 0;
    }
    const bool f32 = w->type == TENSOR_TYPE_BF16;
    const size_t row = (size_t)n_in * (f32 ? 4 : 2);
    const int64_t tile = (int64_t)(cb->wtile_bytes / row);
    for (int64_t r0 = 0; r0 < n_out; r0 += tile) {
        const int rows = (int)(n_out - r0 < tile ? n_out - r0 : tile);
        if (cuda_dequant(cb->compute, w, r0, rows, cb->wtile, f32)) return -1;
        const cudaDataType t = f32 ? CUDA_R_32F : CUDA_R_16F;
        BLAS_CHECK(cb->blas.gemm_ex(cb->handle, CUBLAS_OP_T, CUBLAS_OP_N, rows, n_tok, n_in, &one,
                                    cb->wtile, t, n_in, f32 ? static_cast<const void *>(x) : x16, t,
                                    n_in, &zero, y + r0, CUDA_R_32F, n_out, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
    }
    return 0;
}

/* How a matmul of n_tok rows takes weight w: int8 dot products (mmvq.cu), int8 tensor-core tiles
 * (mmq.cu), the f32 GEMV kernels, or dequantized tiles through cuBLAS (GEMM). */
typedef enum matmul_path { MATMUL_MMVQ, MATMUL_MMQ, MATMUL_GEMV, MATMUL_GEMM } matmul_path;

static matmul_path matmul_path_of(const cuda_backend *cb, const weight *w, int n_tok) {
    if (cb->precision == MATMUL_PRECISION_Q8 && cuda_q8_group(w->type)) {
        if (n_tok <= MMVQ_MAX_TOKENS) return MATMUL_MMVQ;
        if (n_tok <= MMQ_MAX_TOKENS) return MATMUL_MMQ;
    }
    return n_tok <= GEMV_MAX_TOKENS ? MATMUL_GEMV : MATMUL_GEMM;
}

/* y = x W^T, with x quantized once for every weight whose int8 kernel reads the same groups. */
static int cuda_matmul_multi(backend *b, int n_w, const weight *const *w, const float *x, int n_tok,
                             float *const *y) {
    cuda_backend *cb = cuda_of(b);
    if (n_tok == 0) return 0;
    if ((uintptr_t)x % 16 != 0 || w[0]->n_in % 8 != 0) {
        log_error("cuda matmul: activations must be 16-byte aligned, rows a multiple of 8 wide");
        return -1;
    }
    const int64_t n_in = w[0]->n_in;
    int q8 = 0;       /* the group xq holds x in, 0 before the first int8 matmul */
    bool f16 = false; /* x16 holds x */
    for (int i = 0; i < n_w; i++) {
        const matmul_path path = matmul_path_of(cb, w[i], n_tok);
        switch (path) {
        case MATMUL_MMVQ:
        case MATMUL_MMQ: {
            const int group = cuda_q8_group(w[i]->type);
            if ((size_t)n_tok * (size_t)n_in > cb->xq_elems) {
                log_error("cuda matmul: %d rows of %lld exceed the reserved scratch "
                          "(backend_reserve)",
                          n_tok, (long long)n_in);
                return -1;
            }
            if (group != q8 && cuda_quantize_q8(cb->compute, group, x, n_tok, n_in, cb->xq, cb->xd))
                return -1;
            q8 = group;
            if (path == MATMUL_MMVQ ? cuda_mmvq(cb->compute, w[i], cb->xq, cb->xd, n_tok, y[i])
                                    : cuda_mmq(cb->compute, w[i], cb->xq, cb->xd, n_tok, y[i]))
                return -1;
            break;
        }
        case MATMUL_GEMV:
            if (cuda_gemv(cb->compute, w[i], x, n_tok, y[i])) return -1;
            break;
        case MATMUL_GEMM:
            if ((size_t)n_tok * (size_t)n_in > cb->x16_elems || !cb->wtile) {
                log_error("cuda matmul: %d rows of %lld exceed the reserved scratch "
                          "(backend_reserve)",
                          n_tok, (long long)n_in);
                return -1;
            }
            if (!f16 && cuda_to_f16(cb->compute, x, cb->x16, (int64_t)n_tok * n_in)) return -1;
            f16 = true;
            if (gemm(cb, w[i], x, cb->x16, n_tok, y[i])) return -1;
            break;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- row and elementwise ops */

static int cuda_embed_op(backend *b, const weight *w, const int32_t *ids, int n, float *out) {
    if (w->n_in % 8 != 0) {
        log_error("cuda embed: rows must be a multiple of 8 wide");
        return -1;
    }
    return cuda_embed(cuda_of(b)->compute, w, ids, n, out);
}

static int cuda_gather_op(backend *b, float *dst, const float *src, const int32_t *idx, int n,
                          int width) {
    return cuda_gather_rows(cuda_of(b)->compute, dst, src, idx, n, width);
}

static int cuda_rmsnorm_op(backend *b, const float *x, const float *g, float *y, int n_tok, int dim,
                           float eps) {
    return cuda_rmsnorm(cuda_of(b)->compute, x, g, y, n_tok, dim, eps);
}

static int cuda_rope_op(backend *b, float *x, const int32_t *pos, int n_tok, int n_head,
                        int head_dim, const rope_table *rope) {
    return cuda_rope(cuda_of(b)->compute, x, pos, rope->inv_freq, nullptr, nullptr, n_tok, n_head,
                     head_dim, rope->n_rot);
}

static int cuda_rope_angles_op(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                               float *cs) {
    return cuda_rope_angles(cuda_of(b)->compute, rope->inv_freq, rope->n_rot, pos, n_tok, cs);
}

static int cuda_rope_cs_op(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok,
                           int n_head, int head_dim, int n_rot) {
    return cuda_rope(cuda_of(b)->compute, x, nullptr, nullptr, cs, idx, n_tok, n_head, head_dim,
                     n_rot);
}

static int cuda_swiglu_op(backend *b, const float *g, const float *u, float *o, int64_t n) {
    return cuda_swiglu(cuda_of(b)->compute, g, u, o, n);
}

static int cuda_add_op(backend *b, float *y, const float *x, int64_t n) {
    return cuda_add(cuda_of(b)->compute, y, x, n);
}

static int cuda_softmax_op(backend *b, float *x, int n_rows, int n) {
    return cuda_softmax(cuda_of(b)->compute, x, n_rows, n);
}

static int cuda_topk_op(backend *b, const float *x, int n_rows, int n, int k, float *val,
                        int32_t *idx) {
    return cuda_topk(cuda_of(b)->compute, x, n_rows, n, k, val, idx);
}

/* ---------------------------------------------------------------- the KV pool */

static void *cuda_kv_alloc(backend *b, const kv_layout *l) {
    size_t bytes;
    if (size_mul(kv_layout_block_bytes(l), (size_t)l->n_blocks, &bytes)) return nullptr;
    void *p = cuda_alloc(b, bytes);
    if (p && (cudaMemsetAsync(p, 0, bytes, cuda_of(b)->compute) != cudaSuccess ||
              cudaStreamSynchronize(cuda_of(b)->compute) != cudaSuccess)) {
        cudaGetLastError();
        cudaFree(p);
        return nullptr;
    }
    return p;
}

static void cuda_kv_free(backend *b, void *pool) { cuda_free(b, pool); }

static int cuda_kv_write_op(backend *b, void *pool, const kv_layout *l, int layer,
                            const int32_t *table, const int32_t *slots, int n_tok, const float *k,
                            const float *v) {
    return cuda_kv_write(cuda_of(b)->compute, pool, l, layer, table, slots, n_tok, k, v);
}

static int cuda_kv_rope_op(backend *b, void *pool, const kv_layout *l, int layer,
                           const int32_t *table, const int32_t *slots, int n_tok, const float *cs,
                           int n_rot) {
    return cuda_kv_rope(cuda_of(b)->compute, pool, l, layer, table, slots, n_tok, cs, n_rot);
}

static int cuda_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst,
                              int32_t src) {
    const size_t bb = kv_layout_block_bytes(l);
    CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t *>(pool) + (size_t)dst * bb,
                               static_cast<const uint8_t *>(pool) + (size_t)src * bb, bb,
                               cudaMemcpyDeviceToDevice, cuda_of(b)->compute));
    return 0;
}

/* The transfer stream starts after everything queued on the compute stream so far. */
static int xfer_begin(cuda_backend *cb) {
    CUDA_CHECK(cudaEventRecord(cb->xfer_after, cb->compute));
    CUDA_CHECK(cudaStreamWaitEvent(cb->xfer, cb->xfer_after, 0));
    return 0;
}

/* Host rows to or from the pool through the pinned staging, a chunk of tokens at a time: the
 * block table (host) up to the chunk's last block, its slots, and its rows. after_compute: the
 * transfer starts once the compute stream's queued work is done (else at once: kv_store_serial,
 * whose caller writes regions no queued op touches). */
static int kv_transfer(cuda_backend *cb, void *pool, const kv_layout *l, int layer, int kv,
                       const int32_t *table, const int32_t *slots, int n_tok, const float *k,
                       const float *v, float *out, bool after_compute) {
    const size_t kvd = (size_t)l->n_kv_head * l->head_dim;
    const bool load = out != nullptr;
    const size_t per_tok = 4 + kvd * 4 * (load ? 1 : 2);
    int rc = 0;
    pthread_mutex_lock(&cb->xfer_mu);
    if (after_compute && xfer_begin(cb)) rc = -1;
    for (int t0 = 0; rc == 0 && t0 < n_tok;) {
        int max_slot = 0, n = 0;
        size_t table_bytes = 0;
        /* as many tokens as fit beside the table their slots need */
        while (t0 + n < n_tok) {
            int ms = slots[t0 + n] > max_slot ? slots[t0 + n] : max_slot;
            size_t tb = ((size_t)(ms / l->block_tokens + 1) * 4 + 15) & ~(size_t)15;
            if (tb + (size_t)(n + 1) * per_tok + 64 > XFER_BYTES) break;
            max_slot = ms;
            table_bytes = tb;
            n++;
        }
        if (n == 0) {
            log_error("cuda kv transfer: a block table of slot %d does not fit the staging",
                      slots[t0]);
            rc = -1;
            break;
        }
        unsigned char *h = cb->xfer_host, *d = cb->xfer_dev;
        const size_t o_slots = table_bytes, o_rows = (o_slots + 4 * (size_t)n + 15) & ~(size_t)15;
        const size_t rows = (size_t)n * kvd * 4;
        memcpy(h, table, (size_t)(max_slot / l->block_tokens + 1) * 4);
        memcpy(h + o_slots, slots + t0, 4 * (size_t)n);
        size_t up = o_rows;
        if (!load) {
            memcpy(h + o_rows, k + (size_t)t0 * kvd, rows);
            memcpy(h + o_rows + rows, v + (size_t)t0 * kvd, rows);
            up += 2 * rows;
        }
        const int32_t *dt = reinterpret_cast<const int32_t *>(d);
        const int32_t *ds = reinterpret_cast<const int32_t *>(d + o_slots);
        float *dr = reinterpret_cast<float *>(d + o_rows);
        if (cudaMemcpyAsync(d, h, up, cudaMemcpyHostToDevice, cb->xfer) != cudaSuccess)
            rc = -1;
        else if (load ? cuda_kv_gather(cb->xfer, pool, l, layer, kv, dt, ds, n, dr)
                      : cuda_kv_write(cb->xfer, pool, l, layer, dt, ds, n, dr, dr + n * kvd))
            rc = -1;
        else if (load && cudaMemcpyAsync(h + o_rows, dr, rows, cudaMemcpyDeviceToHost, cb->xfer) !=
                             cudaSuccess)
            rc = -1;
        else if (cudaStreamSynchronize(cb->xfer) != cudaSuccess)
            rc = -1;
        if (rc == 0 && load) memcpy(out + (size_t)t0 * kvd, h + o_rows, rows);
        t0 += n;
    }
    pthread_mutex_unlock(&cb->xfer_mu);
    if (rc) {
        cudaError_t e = cudaGetLastError();
        log_error("cuda kv transfer failed: %s", cudaGetErrorString(e));
    }
    return rc;
}

static int cuda_kv_store(backend *b, void *pool, const kv_layout *l, int layer,
                         const int32_t *table, const int32_t *slots, int n_tok, const float *k,
                         const float *v) {
    return kv_transfer(cuda_of(b), pool, l, layer, 0, table, slots, n_tok, k, v, nullptr, true);
}

static int cuda_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                                const int32_t *table, const int32_t *slots, int n_tok,
                                const float *k, const float *v) {
    return kv_transfer(cuda_of(b), pool, l, layer, 0, table, slots, n_tok, k, v, nullptr, false);
}

static int cuda_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                        const int32_t *table, const int32_t *slots, int n_tok, float *out) {
    return kv_transfer(cuda_of(b), const_cast<void *>(pool), l, layer, kv, table, slots, n_tok,
                       nullptr, nullptr, out, true);
}

/* Whole blocks between the pool and host memory: on stream s, or (s NULL, wait) on the transfer
 * stream behind the compute stream's work so far. */
static int kv_blocks(cuda_backend *cb, uint8_t *pool, const kv_layout *l, const int32_t *blocks,
                     int n, uint8_t *host, bool to_host, backend_stream *s, bool wait) {
    const size_t bb = kv_layout_block_bytes(l);
    const bool own = s == nullptr;
    cudaStream_t st = own ? cb->xfer : reinterpret_cast<cudaStream_t>(s);
    int rc = 0;
    if (own) pthread_mutex_lock(&cb->xfer_mu);
    if (own && xfer_begin(cb)) rc = -1;
    for (int i = 0; rc == 0 && i < n; i++) {
        uint8_t *blk = pool + (size_t)blocks[i] * bb, *hb = host + (size_t)i * bb;
        if (cudaMemcpyAsync(to_host ? hb : blk, to_host ? blk : hb, bb,
                            to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                            st) != cudaSuccess)
            rc = -1;
    }
    if (rc == 0 && wait && cudaStreamSynchronize(st) != cudaSuccess) rc = -1;
    if (own) pthread_mutex_unlock(&cb->xfer_mu);
    if (rc) log_error("cuda kv block copy failed: %s", cudaGetErrorString(cudaGetLastError()));
    return rc;
}

static int cuda_kv_read_blocks(backend *b, const void *pool, const kv_layout *l,
                               const int32_t *blocks, int n, void *host, backend_stream *s,
                               bool wait) {
    return kv_blocks(cuda_of(b), static_cast<uint8_t *>(const_cast<void *>(pool)), l, blocks, n,
                     static_cast<uint8_t *>(host), true, s, wait);
}

static int cuda_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                                int n, const void *host, backend_stream *s, bool wait) {
    return kv_blocks(cuda_of(b), static_cast<uint8_t *>(pool), l, blocks, n,
                     static_cast<uint8_t *>(const_cast<void *>(host)), false, s, wait);
}

/* Token rows between the pool and host blocks (a record's payload), through the staging: the
 * block table up to the last slot, then as many of the host blocks the rows touch as fit. The
 * staged host blocks go up first in both directions, so a read leaves the host's other rows as
 * they were. */
static int kv_rows(cuda_backend *cb, void *pool, const kv_layout *l, const int32_t *table, int slot,
                   int n, uint8_t *host, int host_slot, bool to_pool) {
    if (n <= 0) return 0;
    const int bt = l->block_tokens;
    const size_t bb = kv_layout_block_bytes(l);
    const size_t tb = ((size_t)((slot + n - 1) / bt + 1) * 4 + 255) & ~(size_t)255;
    const int64_t fit = tb < XFER_BYTES ? (int64_t)((XFER_BYTES - tb) / bb) : 0;
    if (fit < 1) {
        log_error("cuda kv rows: a %zu-byte block does not fit the transfer staging", bb);
        return -1;
    }
    int rc = 0;
    pthread_mutex_lock(&cb->xfer_mu);
    memcpy(cb->xfer_host, table, (size_t)((slot + n - 1) / bt + 1) * 4);
    if (xfer_begin(cb) || cudaMemcpyAsync(cb->xfer_dev, cb->xfer_host, tb, cudaMemcpyHostToDevice,
                                          cb->xfer) != cudaSuccess)
        rc = -1;
    const int32_t *dt = reinterpret_cast<const int32_t *>(cb->xfer_dev);
    for (int i = 0; rc == 0 && i < n;) {
        const int h0 = host_slot + i, b0 = h0 / bt;
        const int cnt = (int)((int64_t)(b0 + fit) * bt - h0 < n - i ? (b0 + fit) * bt - h0 : n - i);
        const int nb = (h0 + cnt - 1) / bt - b0 + 1;
        uint8_t *hs = cb->xfer_host + tb, *ds = cb->xfer_dev + tb;
        /* the previous chunk's copies are done (synchronised below) before its staging is reused */
        memcpy(hs, host + (size_t)b0 * bb, (size_t)nb * bb);
        if (cudaMemcpyAsync(ds, hs, (size_t)nb * bb, cudaMemcpyHostToDevice, cb->xfer) !=
                cudaSuccess ||
            cuda_kv_rows(cb->xfer, pool, l, dt, slot + i, cnt, ds, h0 - b0 * bt, to_pool) ||
            (!to_pool && cudaMemcpyAsync(hs, ds, (size_t)nb * bb, cudaMemcpyDeviceToHost,
                                         cb->xfer) != cudaSuccess) ||
            cudaStreamSynchronize(cb->xfer) != cudaSuccess) {
            rc = -1;
            break;
        }
        if (!to_pool) memcpy(host + (size_t)b0 * bb, hs, (size_t)nb * bb);
        i += cnt;
    }
    pthread_mutex_unlock(&cb->xfer_mu);
    if (rc) log_error("cuda kv rows failed: %s", cudaGetErrorString(cudaGetLastError()));
    return rc;
}

static int cuda_kv_read_rows(backend *b, const void *pool, const kv_layout *l, const int32_t *table,
                             int slot, int n, void *host, int host_slot) {
    return kv_rows(cuda_of(b), const_cast<void *>(pool), l, table, slot, n,
                   static_cast<uint8_t *>(host), host_slot, false);
}

static int cuda_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *table,
                              int slot, int n, const void *host, int host_slot) {
    return kv_rows(cuda_of(b), pool, l, table, slot, n,
                   static_cast<uint8_t *>(const_cast<void *>(host)), host_slot, true);
}

/* ---------------------------------------------------------------- attention */

static const attn_desc *graph_descs(cuda_backend *cb, int n); /* step graphs, below */

/* Descriptors of the call's sequences (host, then up through a pinned slot), the warps or
 * tensor-core blocks each takes (prefill-sized sequences: ATTN_TC_MIN_ROWS), and where split
 * rows keep their partial states; then the kernels. */
static int cuda_attention_op(backend *b, const void *pool, const kv_layout *l, int layer,
                             int n_head, float scale, const attn_seq *seqs, int n_seqs) {
    cuda_backend *cb = cuda_of(b);
    if (n_seqs > cb->desc_cap) {
        log_error("cuda attention: %d sequences exceed the %d reserved (backend_reserve)", n_seqs,
                  cb->desc_cap);
        return -1;
    }
    int warps = 0, mwarps = 0, tblocks = 0;
    int64_t part = 0;
    const int64_t state = l->head_dim + 2;
    const bool tc = cuda_attention_tc_fits(l, n_head);
    const bool recording = cb->recording != nullptr;
    for (int s = 0; s < n_seqs; s++) {
        const attn_seq *a = &seqs[s];
        attn_desc d;
        memset(&d, 0, sizeof d); /* padding too: recorded sets are compared with memcmp */
        d.table = a->block_table, d.q_slot = a->q_slot, d.q = a->q, d.out = a->out;
        d.n_q = a->n_q, d.n_split = 1, d.warp0 = warps, d.mwarp0 = mwarps, d.part0 = part;
        d.tblock0 = tblocks;
        if (tc && a->n_q >= ATTN_TC_MIN_ROWS) {
            cb->hdesc[s] = d;
            tblocks += cuda_attention_tc_blocks(l, n_head, a->n_q);
            continue;
        }
        /* a recorded step's rows get warps for the most ranges and use what their keys give
         * when it replays (n_kv changes from replay to replay) */
        int ns = 1;
        if (a->split_keys && a->n_q <= ATTN_SPLIT_ROWS) {
            ns = recording ? ATTN_MAX_SPLIT : attn_split_count(a->n_kv, ATTN_MAX_SPLIT);
            if ((part + (int64_t)a->n_q * n_head * ns) * state > (int64_t)cb->part_floats) ns = 1;
        }
        d.n_split = ns, d.row_split = recording && ns > 1;
        cb->hdesc[s] = d;
        warps += a->n_q * n_head * ns;
        if (ns > 1) {
            mwarps += a->n_q * n_head;
            part += (int64_t)a->n_q * n_head * ns;
        }
    }
    if (warps == 0 && tblocks == 0) return 0;
    const attn_desc *desc = cb->desc;
    if (recording) {
        if (!(desc = graph_descs(cb, n_seqs))) return -1;
    } else if (cuda_upload(cb, cb->desc, cb->hdesc, sizeof(attn_desc) * n_seqs, cb->compute)) {
        return -1;
    }
    return cuda_attention(cb->compute, pool, l, layer, n_head, scale, desc, n_seqs, warps, mwarps,
                          tblocks, cb->part);
}

/* ---------------------------------------------------------------- step graphs */

/* The recording graph's device copy of hdesc[0..n): a set it holds already (every layer of a
 * step reads the same one), else a new one written when the recording ends. */
static const attn_desc *graph_descs(cuda_backend *cb, int n) {
    step_graph *g = cb->recording;
    const size_t bytes = sizeof(attn_desc) * (size_t)n;
    for (int i = 0; i + n <= g->n_desc; i++)
        if (memcmp(g->hdesc + i, cb->hdesc, bytes) == 0) return g->desc + i;
    if (g->n_desc + n > GRAPH_DESC_SETS * g->desc_cap) {
        log_error("cuda graphs: a step's attention calls need more than %d descriptor sets",
                  GRAPH_DESC_SETS);
        cb->record_failed = true;
        return nullptr;
    }
    memcpy(g->hdesc + g->n_desc, cb->hdesc, bytes);
    g->n_desc += n;
    return g->desc + g->n_desc - n;
}

/* Frees graph i (after the device has run its replays) and closes the gap. */
static void graph_drop(cuda_backend *cb, int i) {
    step_graph *g = &cb->graphs[i];
    cudaStreamSynchronize(cb->compute);
    if (g->exec) cudaGraphExecDestroy(g->exec);
    cudaFree(g->desc);
    free(g->hdesc);
    cb->graphs[i] = cb->graphs[--cb->n_graphs];
    memset(&cb->graphs[cb->n_graphs], 0, sizeof(step_graph));
}

static void graphs_clear(cuda_backend *cb) {
    while (cb->n_graphs > 0) graph_drop(cb, cb->n_graphs - 1);
}

static void cuda_set_graphs(backend *b, bool on) {
    cuda_backend *cb = cuda_of(b);
    cb->graphs_on = on;
    if (!on) graphs_clear(cb);
}

static bool cuda_graphs(const backend *b) {
    return reinterpret_cast<const cuda_backend *>(b)->graphs_on;
}

static void cuda_graph_forget(backend *b, const void *owner) {
    cuda_backend *cb = cuda_of(b);
    for (int i = cb->n_graphs - 1; i >= 0; i--)
        if (cb->graphs[i].owner == owner) graph_drop(cb, i);
}

static backend_graph_mode cuda_graph_begin(backend *b, const void *owner, const void *key,
                                           size_t key_bytes) {
    cuda_backend *cb = cuda_of(b);
    if (!cb->graphs_on || cb->recording || cb->replaying || key_bytes > GRAPH_KEY_BYTES ||
        cb->desc_cap == 0)
        return BACKEND_GRAPH_DIRECT;
    cb->steps++;
    for (int i = 0; i < cb->n_graphs; i++) {
        step_graph *g = &cb->graphs[i];
        if (g->owner == owner && g->key_bytes == key_bytes && g->precision == cb->precision &&
            memcmp(g->key, key, key_bytes) == 0) {
            g->used = cb->steps;
            cb->replaying = g;
            return BACKEND_GRAPH_REPLAY;
        }
    }
    if (cb->n_graphs == GRAPH_CACHE) {
        int lru = 0;
        for (int i = 1; i < cb->n_graphs; i++)
            if (cb->graphs[i].used < cb->graphs[lru].used) lru = i;
        graph_drop(cb, lru);
    }
    step_graph *g = &cb->graphs[cb->n_graphs++];
    g->owner = owner;
    memcpy(g->key, key, key_bytes);
    g->key_bytes = key_bytes;
    g->precision = cb->precision;
    g->used = cb->steps;
    g->desc_cap = cb->desc_cap;
    const size_t desc_bytes = sizeof(attn_desc) * GRAPH_DESC_SETS * (size_t)g->desc_cap;
    g->hdesc = static_cast<attn_desc *>(malloc(desc_bytes));
    cudaError_t e =
        g->hdesc ? cudaMalloc((void **)&g->desc, desc_bytes) : cudaErrorMemoryAllocation;
    /* thread-local: a host wait on this thread inside the step fails the recording; other
     * threads (cache loads on the transfer stream) go on */
    if (e == cudaSuccess) e = cudaStreamBeginCapture(cb->compute, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        log_warn("cuda graphs: cannot record a step (%s): steps run directly",
                 cudaGetErrorString(e));
        graph_drop(cb, cb->n_graphs - 1);
        cb->graphs_on = false;
        return BACKEND_GRAPH_DIRECT;
    }
    cb->recorder = pthread_self();
    cb->recording = g;
    cb->record_failed = false;
    return BACKEND_GRAPH_RECORD;
}

/* Ends the recording (the descriptors go up, the graph is instantiated) and launches. */
static int graph_finish(cuda_backend *cb, step_graph *g) {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(cb->compute, &graph);
    if (e == cudaSuccess && cb->record_failed) e = cudaErrorStreamCaptureInvalidated;
    /* on the compute stream, so the launch below is ordered after it (a cudaMemcpy from
     * pageable memory may return before its DMA is done) */
    if (e == cudaSuccess && g->n_desc > 0)
        e = cudaMemcpyAsync(g->desc, g->hdesc, sizeof(attn_desc) * g->n_desc,
                            cudaMemcpyHostToDevice, cb->compute);
    if (e == cudaSuccess) e = cudaGraphInstantiateWithFlags(&g->exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e == cudaSuccess) e = cudaGraphLaunch(g->exec, cb->compute);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();
    log_warn("cuda graphs: a step could not be recorded (%s): steps run directly from now on",
             cudaGetErrorString(e));
    cb->graphs_on = false;
    graphs_clear(cb);
    return -1;
}

static int cuda_graph_end(backend *b) {
    cuda_backend *cb = cuda_of(b);
    step_graph *g = cb->replaying;
    if (g) {
        cb->replaying = nullptr;
        CUDA_CHECK(cudaGraphLaunch(g->exec, cb->compute));
        return 0;
    }
    if (!(g = cb->recording)) return 0;
    cb->recording = nullptr;
    return graph_finish(cb, g);
}

/* ---------------------------------------------------------------- the table */

const backend_ops cuda_ops = {
    cuda_destroy,
    cuda_name,
    cuda_n_threads,
    cuda_set_precision,
    cuda_reserve,
    cuda_alloc,
    cuda_free,
    cuda_weight_data,
    cuda_weight_release,
    nullptr, /* weight_repack: the device kernels read GGUF's layout */
    cuda_upload_op,
    cuda_download,
    cuda_sync,
    cuda_host_alloc,
    cuda_host_free,
    cuda_stream_create,
    cuda_stream_destroy,
    cuda_event_create,
    cuda_event_destroy,
    cuda_event_record,
    cuda_stream_wait,
    cuda_event_sync,
    cuda_matmul_multi,
    cuda_embed_op,
    cuda_gather_op,
    cuda_rmsnorm_op,
    cuda_rope_op,
    cuda_rope_angles_op,
    cuda_rope_cs_op,
    cuda_swiglu_op,
    cuda_add_op,
    cuda_softmax_op,
    cuda_topk_op,
    cuda_kv_alloc,
    cuda_kv_free,
    cuda_kv_write_op,
    cuda_kv_store,
    cuda_kv_store_serial,
    cuda_kv_load,
    cuda_kv_rope_op,
    cuda_kv_copy_block,
    cuda_kv_read_blocks,
    cuda_kv_write_blocks,
    cuda_kv_read_rows,
    cuda_kv_write_rows,
    cuda_attention_op,
    cuda_set_graphs,
    cuda_graphs,
    cuda_graph_begin,
    cuda_graph_end,
    cuda_graph_forget,
};

} // namespace KV_CUDA_NS

#ifdef KVSERVE_CUDA_EMU
extern "C" backend *backend_cuda_emu_create(kv_error *err) { return KV_CUDA_NS::create(err, true); }
#else
extern "C" backend *backend_cuda_create(kv_error *err) { return KV_CUDA_NS::create(err, false); }
#endif

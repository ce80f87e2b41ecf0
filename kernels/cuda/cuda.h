/* Internals of the CUDA backend (kernels/cuda/): the backend's struct, error checks, and the
 * launch wrappers each .cu file gives the others. Not part of the kernels/ contract (that is
 * kernels/backend.h). Everything here lives in KV_CUDA_NS (kvcuda, or kvcuda_emu in the
 * emulation build), so both builds can sit in one program. */
#ifndef KVSERVE_CUDA_H
#define KVSERVE_CUDA_H

#include <pthread.h>

#include "kernels/cuda/cuda_rt.h"

#ifndef KVSERVE_CUDA_EMU
#include <cublas_v2.h>
#endif

namespace KV_CUDA_NS {

/* ---------------------------------------------------------------- errors */

/* Logs a failed runtime call and makes the enclosing function return -1. */
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            log_error("cuda: %s: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__);  \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

/* After a launch: a configuration error shows at once; faults inside a kernel show at the next
 * synchronising call. */
#define CUDA_CHECK_LAUNCH(what) CUDA_CHECK(cudaGetLastError())

/* ---------------------------------------------------------------- the backend */

/* cuBLAS, loaded when the backend starts (dlopen: linking it costs every kvserve process ~200 MiB
 * of relocated pages, GPU or not); the emulator's reference GEMM in the emulation build. */
typedef struct cublas_api {
    void *lib;
    cublasStatus_t (*create)(cublasHandle_t *h);
    cublasStatus_t (*destroy)(cublasHandle_t h);
    cublasStatus_t (*set_stream)(cublasHandle_t h, cudaStream_t s);
    /* optional: cuBLAS then takes no device memory of its own while it runs */
    cublasStatus_t (*set_workspace)(cublasHandle_t h, void *ws, size_t bytes);
    cublasStatus_t (*gemm_ex)(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                              int n, int k, const void *alpha, const void *A, cudaDataType at,
                              int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                              void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                              cublasGemmAlgo_t algo);
} cublas_api;

/* A weight range uploaded once: host (the mmapped file) -> device, while refs > 0. */
typedef struct weight_copy {
    const void *host;
    size_t bytes;
    void *dev;
    int refs;
} weight_copy;

/* Host -> device uploads go through pinned slots (the host may reuse its buffer at once, and
 * the copy stays asynchronous): slot i is reused once its event says the copy read it. */
#define UPLOAD_SLOTS 16
#define UPLOAD_SLOT_BYTES (256 * 1024)

/* cuBLAS's workspace (what NVIDIA recommends for Hopper; Ampere needs less). */
#define BLAS_WORKSPACE (32u << 20)

/* Staging for the host-facing KV transfers (kv_store, kv_load), chunked through it. */
#define XFER_BYTES (4 * 1024 * 1024)

/* An int8 matmul's activations (mmvq.cu), per 32 elements: the scale of their block (32 elements,
 * fp16-rounded) or of their super-block (256, f32), and the sum of their 32 int8 codes. */
typedef struct q8_ds {
    __align__(8) float d; /* 8-byte aligned: one load */
    int sum;
} q8_ds;

/* One sequence of an attention call, as the kernels read it (device memory). */
typedef struct attn_desc {
    const int32_t *table;
    const int32_t *q_slot;
    const float *q;
    float *out;
    int n_q;
    int n_split;    /* key ranges per query row (flash-decoding); 1: not split */
    bool row_split; /* each row uses attn_split_count(its keys, n_split) of them (a graph's
                       step: the warps are fixed, the keys are not); else all n_split */
    int warp0;      /* first warp of the attention kernel: n_q * n_head * n_split warps */
    int mwarp0;     /* first warp of the merge kernel: n_q * n_head when split, else none */
    int64_t part0;  /* first partial state (of head_dim + 2 floats) when split */
    int tblock0;    /* first block of the tensor-core kernel: n_kv_head * ceil(n_q * group / 64)
                       blocks when it takes the sequence (then no warps above), else none */
} attn_desc;

/* ---------------------------------------------------------------- step graphs */

/* Decode steps recorded once per shape and replayed as CUDA graphs (backend_graph_begin in
 * kernels/backend.h). A graph's kernels read the same pointers and sizes every replay; what
 * changes between steps is in the caller's backend memory, uploaded before the replay. The one
 * table the backend fills itself, attention's descriptors, depends only on the shape: a graph
 * keeps its own on the device (GRAPH_DESC_SETS sets of up to desc_cap), written once when it is
 * recorded; the split of each row's keys is chosen on the device (attn_desc.row_split). */
#define GRAPH_CACHE                                                                                \
    64 /* graphs kept (batch widths x table strides); the least recently                           \
          replayed one makes room */
#define GRAPH_KEY_BYTES BACKEND_GRAPH_KEY_MAX
#define GRAPH_DESC_SETS 4 /* distinct descriptor sets of one step (layers share one) */

typedef struct step_graph {
    const void *owner; /* the caller's (backend_graph_forget) */
    unsigned char key[GRAPH_KEY_BYTES];
    size_t key_bytes;
    matmul_precision precision; /* the matmul paths it recorded */
    cudaGraphExec_t exec;
    attn_desc *desc;  /* [GRAPH_DESC_SETS * desc_cap] device */
    attn_desc *hdesc; /* [GRAPH_DESC_SETS * desc_cap] host: what desc holds */
    int n_desc;       /* descriptors in use */
    int desc_cap;     /* per set */
    uint64_t used;    /* the step it was last begun at (least recently used goes) */
} step_graph;

typedef struct cuda_backend {
    backend base; /* ops: the table in backend_cuda.cu */
    bool emulated;
    char device[320];     /* name, compute capability, memory */
    cudaStream_t compute; /* every op */
    cudaStream_t xfer;    /* the host-facing KV transfers, ordered after compute by events */
    cudaEvent_t xfer_after;
    cublas_api blas;
    cublasHandle_t handle;
    void *blas_ws;              /* [BLAS_WORKSPACE] */
    matmul_precision precision; /* Q8: int8 kernels for decode-sized matmuls; F32: f32 GEMV */

    pthread_mutex_t mu;      /* the weights table and the upload slots (host threads share them) */
    pthread_mutex_t xfer_mu; /* the transfer stream and its staging */
    weight_copy *weights;
    int n_weights, cap_weights;

    /* uploads */
    unsigned char *up_host; /* pinned: [UPLOAD_SLOTS][UPLOAD_SLOT_BYTES] */
    cudaEvent_t up_done[UPLOAD_SLOTS];
    int up_next;

    /* host-facing transfers */
    unsigned char *xfer_host; /* pinned [XFER_BYTES] */
    unsigned char *xfer_dev;  /* [XFER_BYTES] */

    /* scratch reserved by backend_reserve */
    backend_limits lim;
    uint16_t *x16; /* [max_tokens][max_n_in] f16 activations of a GEMM */
    size_t x16_elems;
    void *wtile; /* dequantized weight rows for a GEMM, f16 or f32 */
    size_t wtile_bytes;
    int8_t *xq;      /* [max(max_tokens, MMVQ_MAX_TOKENS)][max_n_in] int8 activation codes of an
                        int8 matmul (mmvq, mmq) */
    q8_ds *xd;       /* [the same rows][max_n_in / 32] their scales and sums */
    size_t xq_elems; /* codes xq holds (rows x max_n_in) */
    float *part;     /* attention partial states of split rows */
    size_t part_floats;
    attn_desc *desc;  /* [desc_cap] device */
    attn_desc *hdesc; /* [desc_cap] host */
    int desc_cap;

    /* step graphs (one host thread issues a backend's steps) */
    bool graphs_on; /* backend_set_graphs; off after a recording failed */
    step_graph graphs[GRAPH_CACHE];
    int n_graphs;
    uint64_t steps;        /* backend_graph_begin calls */
    step_graph *recording; /* between a RECORD begin and its end */
    pthread_t recorder;    /* the thread recording (other threads' uploads go on) */
    step_graph *replaying; /* between a REPLAY begin and its end */
    bool record_failed;    /* an op refused to be recorded */
} cuda_backend;

static inline cuda_backend *cuda_of(backend *b) { return (cuda_backend *)b; }

/* Queues a host -> device copy on stream s through a pinned slot (large copies wait). */
int cuda_upload(cuda_backend *cb, void *dst, const void *src, size_t bytes, cudaStream_t s);

/* ---------------------------------------------------------------- launch wrappers */

/* matmul.cu */
/* Matmuls of up to this many rows that the int8 kernels do not take (F32, F16 and BF16 weights,
 * or MATMUL_PRECISION_F32) use the f32 GEMV kernels; more go through dequantized tiles and
 * cuBLAS. Measured on an H200 (gpu_bench, Q4_K 4096 x 14336, wide loads and 16-byte tile stores):
 * GEMV 853 GB/s of weights at 1 row, 486 at 4 and 216 at 8, against 320 for the tiles at 16 rows
 * (the tiles' rate hardly depends on the rows: the dequantization dominates). */
#define GEMV_MAX_TOKENS 4
int cuda_gemv(cudaStream_t s, const weight *w, const float *x, int n_tok, float *y);
/* W rows [r0, r0 + rows) as f16 (or f32 when f32) rows of n_in. */
int cuda_dequant(cudaStream_t s, const weight *w, int64_t r0, int64_t rows, void *out, bool f32);
int cuda_to_f16(cudaStream_t s, const float *x, uint16_t *y, int64_t n);
int cuda_embed(cudaStream_t s, const weight *w, const int32_t *ids, int n, float *out);

/* mmvq.cu */
/* Matmuls of up to this many rows on a quantized weight run on int8 dot products (the default
 * MATMUL_PRECISION_Q8): the activations quantized once per op, each weight read once for all
 * rows. Not yet measured on a GPU. */
#define MMVQ_MAX_TOKENS 8
/* The activation group a weight type's int8 kernel reads: 32 (the 32-element types), 256
 * (K-quants), or 0 where it has none. */
int cuda_q8_group(tensor_type t);
/* x [n_tok][n_in] f32 -> codes xq [n_tok][n_in] int8 and xd [n_tok][n_in / 32], in groups of
 * `group` elements, as the CPU's quantize_row_act quantizes them (the same codes and scales). */
int cuda_quantize_q8(cudaStream_t s, int group, const float *x, int n_tok, int64_t n_in, int8_t *xq,
                     q8_ds *xd);
/* y [n_tok][n_out] = x W^T from x quantized by cuda_quantize_q8 in w's group (1..MMVQ_MAX_TOKENS
 * rows). */
int cuda_mmvq(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd, int n_tok,
              float *y);

/* mmq.cu */
/* Matmuls of more than MMVQ_MAX_TOKENS and up to this many rows on a quantized weight at
 * MATMUL_PRECISION_Q8 run on int8 tensor-core tiles straight from the weight's blocks (mmq.cu);
 * more go through dequantized f16 tiles and cuBLAS (backend_cuda.cu, gemm). The crossover is
 * where cuBLAS's f16 GEMM on a dequantized copy overtakes the int8 tiles; gpu_bench prints both
 * rates per prefill size to place it. Not yet measured on a GPU: until then every prefill size
 * takes the int8 tiles (llama.cpp's mmq wins at every batch size on its own benchmarks). */
#define MMQ_MAX_TOKENS (1 << 30)
/* y [n_tok][n_out] = x W^T from x quantized by cuda_quantize_q8 in w's group (any n_tok >= 1;
 * the dispatch gives it more than MMVQ_MAX_TOKENS). */
int cuda_mmq(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd, int n_tok,
             float *y);

/* ops.cu */
int cuda_rmsnorm(cudaStream_t s, const float *x, const float *g, float *y, int n_tok, int dim,
                 float eps);
int cuda_rope_angles(cudaStream_t s, const float *inv_freq, int n_rot, const int32_t *pos,
                     int n_tok, float *cs);
int cuda_rope(cudaStream_t s, float *x, const int32_t *pos, const float *inv_freq, const float *cs,
              const int32_t *idx, int n_tok, int n_head, int head_dim, int n_rot);
int cuda_swiglu(cudaStream_t s, const float *g, const float *u, float *o, int64_t n);
int cuda_add(cudaStream_t s, float *y, const float *x, int64_t n);
int cuda_gather_rows(cudaStream_t s, float *dst, const float *src, const int32_t *idx, int n,
                     int width);
int cuda_softmax(cudaStream_t s, float *x, int n_rows, int n);
int cuda_topk(cudaStream_t s, const float *x, int n_rows, int n, int k, float *val, int32_t *idx);

/* attention.cu */
int cuda_kv_write(cudaStream_t s, void *pool, const kv_layout *l, int layer, const int32_t *table,
                  const int32_t *slots, int n_tok, const float *k, const float *v);
int cuda_kv_gather(cudaStream_t s, const void *pool, const kv_layout *l, int layer, int kv,
                   const int32_t *table, const int32_t *slots, int n_tok, float *out);
int cuda_kv_rope(cudaStream_t s, void *pool, const kv_layout *l, int layer, const int32_t *table,
                 const int32_t *slots, int n_tok, const float *cs, int n_rot);
/* Token rows slot.. (n) of the pool <-> stage, blocks in the pool's layout holding them from
 * stage_slot on (stage slot h: slot h % block_tokens of stage block h / block_tokens). */
int cuda_kv_rows(cudaStream_t s, void *pool, const kv_layout *l, const int32_t *table, int slot,
                 int n, void *stage, int stage_slot, bool to_pool);
int cuda_attention(cudaStream_t s, const void *pool, const kv_layout *l, int layer, int n_head,
                   float scale, const attn_desc *desc, int n_seqs, int n_warps, int n_mwarps,
                   int n_tblocks, float *part);
/* Whether the tensor-core kernel handles this layout (head_dim a multiple of 16 up to
 * ATTN_TC_MAX_HD, block_tokens a multiple of 16), and its blocks for a sequence of n_q rows. */
bool cuda_attention_tc_fits(const kv_layout *l, int n_head);
int cuda_attention_tc_blocks(const kv_layout *l, int n_head, int n_q);

/* Split decode rows into key ranges of at least this many keys (a warp's tile), at most
 * ATTN_MAX_SPLIT: a decode step has only n_seqs x n_head rows, and a warp that walks a long range
 * alone is latency-bound (on an H200, 256-key ranges made attention 2/3 of an 8B-shape decode
 * step at context 512). */
#define ATTN_MIN_SPLIT_KEYS 32
#define ATTN_MAX_SPLIT 32
/* Rows of a sequence that may split (decode steps): at most this many per sequence. */
#define ATTN_SPLIT_ROWS 4
/* Sequences of at least this many query rows (prefill) go to the tensor-core kernel, whose
 * blocks take 64 rows of a KV head's group (n_q x n_head / n_kv_head stacked rows): fewer rows
 * would leave most of a tile padding, and decode rows keep the split-key warps above. A first
 * guess, not yet measured on a device (gpu_bench's attention row compares the two). */
#define ATTN_TC_MIN_ROWS 16
#define ATTN_TC_MAX_HD 128 /* model/llama.c's limit; larger head dims use the warps */

/* The key ranges of a decode row with n_keys keys, at most cap: ranges of at least
 * ATTN_MIN_SPLIT_KEYS, unsplit below two of them. The host's choice and, for a graph's rows
 * (attn_desc.row_split), the device's: the two give the same ranges, so the same bits. */
__host__ __device__ __forceinline__ int attn_split_count(int n_keys, int cap) {
    int ns = n_keys >= 2 * ATTN_MIN_SPLIT_KEYS ? n_keys / ATTN_MIN_SPLIT_KEYS : 1;
    ns = ns > ATTN_MAX_SPLIT ? ATTN_MAX_SPLIT : ns;
    return ns < cap ? ns : cap;
}

} // namespace KV_CUDA_NS

#endif

/* Llama-family models from GGUF (architecture "llama": Llama 2, Llama 3.x, Mistral 7B, SmolLM2):
 * hyperparameters, weights checked against them, the RoPE table, and the model identity. */
#include <math.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

/* Limits of the CPU kernels, checked here so the ops can trust their shapes. */
#define MAX_HEAD_DIM 128
#define MAX_GQA 8
#define MAX_ROT 512

/* ---------------------------------------------------------------- hyperparameters */

static int get_int(const gguf_file *g, const char *key, int lo, int hi, int *out, bool required,
                   kv_error *err) {
    if (!gguf_has_key(g, key)) {
        if (required) return kv_fail(err, "missing metadata key %s", key);
        return 0;
    }
    int64_t v;
    if (gguf_get_i64(g, key, &v, err) != 0) return -1;
    if (v < lo || v > hi)
        return kv_fail(err, "%s = %lld is out of range [%d, %d]", key, (long long)v, lo, hi);
    *out = (int)v;
    return 0;
}

static int get_float(const gguf_file *g, const char *key, float *out, kv_error *err) {
    if (!gguf_has_key(g, key)) return 0;
    double v;
    if (gguf_get_f64(g, key, &v, err) != 0) return -1;
    if (!isfinite(v)) return kv_fail(err, "%s is not finite", key);
    *out = (float)v;
    return 0;
}

static int load_hparams(const gguf_file *g, model_hparams *hp, kv_error *err) {
    const char *arch;
    size_t arch_len;
    if (gguf_get_str(g, "general.architecture", &arch, &arch_len, err) != 0) return -1;
    if (arch_len != 5 || memcmp(arch, "llama", 5) != 0)
        return kv_fail(err,
                       "unsupported architecture '%.*s' (kvserve runs 'llama': Llama 2/3, "
                       "Mistral, SmolLM2)",
                       (int)(arch_len > 64 ? 64 : arch_len), arch);
    int experts = 0;
    if (get_int(g, "llama.expert_count", 0, 1 << 16, &experts, false, err)) return -1;
    if (experts > 0)
        return kv_fail(err, "mixture-of-experts llama models (%d experts) are not supported",
                       experts);
    memset(hp, 0, sizeof *hp);
    if (get_int(g, "llama.block_count", 1, 1024, &hp->n_layer, true, err) ||
        get_int(g, "llama.context_length", 1, 1 << 24, &hp->n_ctx_train, true, err) ||
        get_int(g, "llama.embedding_length", 16, 1 << 16, &hp->dim, true, err) ||
        get_int(g, "llama.feed_forward_length", 16, 1 << 18, &hp->ffn_dim, true, err) ||
        get_int(g, "llama.attention.head_count", 1, 1024, &hp->n_head, true, err))
        return -1;
    hp->n_kv_head = hp->n_head;
    if (get_int(g, "llama.attention.head_count_kv", 1, 1024, &hp->n_kv_head, false, err)) return -1;
    if (hp->dim % hp->n_head != 0)
        return kv_fail(err, "embedding_length %d is not a multiple of head_count %d", hp->dim,
                       hp->n_head);
    hp->head_dim = hp->dim / hp->n_head;
    if (get_int(g, "llama.attention.key_length", 1, 4096, &hp->head_dim, false, err)) return -1;
    int vlen = hp->head_dim;
    if (get_int(g, "llama.attention.value_length", 1, 4096, &vlen, false, err)) return -1;
    if (vlen != hp->head_dim)
        return kv_fail(err, "key_length %d != value_length %d is not supported", hp->head_dim,
                       vlen);
    if (hp->head_dim % 16 != 0 || hp->head_dim > MAX_HEAD_DIM)
        return kv_fail(err, "head dimension %d is not supported (a multiple of 16, <= %d)",
                       hp->head_dim, MAX_HEAD_DIM);
    if (hp->n_head % hp->n_kv_head != 0 || hp->n_head / hp->n_kv_head > MAX_GQA)
        return kv_fail(err, "head_count %d / head_count_kv %d is not supported", hp->n_head,
                       hp->n_kv_head);
    hp->n_rot = hp->head_dim;
    if (get_int(g, "llama.rope.dimension_count", 2, MAX_ROT, &hp->n_rot, false, err)) return -1;
    if (hp->n_rot % 2 != 0 || hp->n_rot > hp->head_dim)
        return kv_fail(err, "rope.dimension_count %d must be even and <= head dim %d", hp->n_rot,
                       hp->head_dim);
    hp->norm_eps = 1e-5f;
    hp->rope_base = 10000.0f;
    hp->rope_factor = 1.0f;
    if (get_float(g, "llama.attention.layer_norm_rms_epsilon", &hp->norm_eps, err) ||
        get_float(g, "llama.rope.freq_base", &hp->rope_base, err))
        return -1;
    if (hp->norm_eps <= 0 || hp->rope_base <= 1.0f)
        return kv_fail(err, "bad rms epsilon %g or rope base %g", hp->norm_eps, hp->rope_base);
    if (gguf_has_key(g, "llama.rope.scaling.type")) {
        const char *st;
        size_t sl;
        if (gguf_get_str(g, "llama.rope.scaling.type", &st, &sl, err)) return -1;
        if (sl == 4 && memcmp(st, "none", 4) == 0) {
            hp->rope_scaling_type = ROPE_SCALING_NONE;
        } else if (sl == 6 && memcmp(st, "linear", 6) == 0) {
            hp->rope_scaling_type = ROPE_SCALING_LINEAR;
        } else if (sl == 6 && memcmp(st, "llama3", 6) == 0) {
            hp->rope_scaling_type = ROPE_SCALING_LLAMA3;
        } else {
            return kv_fail(err, "rope scaling '%.*s' is not supported (none, linear, llama3)",
                           (int)(sl > 32 ? 32 : sl), st);
        }
        if (get_float(g, "llama.rope.scaling.factor", &hp->rope_factor, err)) return -1;
        if (!(hp->rope_factor >= 1.0f))
            return kv_fail(err, "rope.scaling.factor %g must be >= 1", hp->rope_factor);
    } else if (gguf_has_key(g, "llama.rope.scale_linear")) {
        if (get_float(g, "llama.rope.scale_linear", &hp->rope_factor, err)) return -1;
        if (!(hp->rope_factor >= 1.0f))
            return kv_fail(err, "rope.scale_linear %g must be >= 1", hp->rope_factor);
        hp->rope_scaling_type = hp->rope_factor > 1.0f ? ROPE_SCALING_LINEAR : ROPE_SCALING_NONE;
    }
    return 0;
}

/* ---------------------------------------------------------------- tensors */

static const gguf_tensor *find_tensor(const gguf_file *g, const char *name, int64_t ne0,
                                      int64_t ne1, bool required, kv_error *err) {
    const gguf_tensor *t = gguf_find_tensor(g, name);
    if (!t) {
        if (required) kv_fail(err, "missing tensor %s", name);
        return NULL;
    }
    int64_t want1 = ne1 ? ne1 : 1;
    if (t->ne[0] != ne0 || t->ne[1] != want1 || t->ne[2] != 1 || t->ne[3] != 1) {
        kv_fail(err, "tensor %s has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]", name,
                (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                (long long)ne0, (long long)want1);
        return NULL;
    }
    return t;
}

static int load_weight(const gguf_file *g, const char *name, int64_t n_in, int64_t n_out, weight *w,
                       kv_error *err) {
    const gguf_tensor *t = find_tensor(g, name, n_in, n_out, true, err);
    if (!t) return -1;
    const tensor_type_traits *tr = tensor_type_get((int)t->type);
    if (!tr || !tr->weight_supported)
        return kv_fail(err, "tensor %s: type %s is not supported as a matrix", name,
                       tr ? tr->name : "?");
    w->type = t->type;
    w->n_in = n_in;
    w->n_out = n_out;
    w->row_bytes = tensor_row_size(t->type, n_in);
    w->data = t->data;
    return 0;
}

/* Norm vectors are f32 in every llama GGUF we know; F16/BF16 ones are converted into
 * m->norm_f32 (slot `index`, dim floats each). */
static int load_norm(model *m, const char *name, int index, const float **out, kv_error *err) {
    const gguf_tensor *t = find_tensor(m->gguf, name, m->hp.dim, 0, true, err);
    if (!t) return -1;
    if (t->type == TENSOR_TYPE_F32) {
        *out = t->data;
        return 0;
    }
    if (t->type != TENSOR_TYPE_F16 && t->type != TENSOR_TYPE_BF16)
        return kv_fail(err, "tensor %s: norm weights must be F32, F16 or BF16", name);
    float *dst = m->norm_f32 + (size_t)index * m->hp.dim;
    dequantize_row(t->type, t->data, dst, m->hp.dim);
    *out = dst;
    return 0;
}

static int load_weights(model *m, kv_error *err) {
    const model_hparams *hp = &m->hp;
    const gguf_file *g = m->gguf;
    int qd = hp->n_head * hp->head_dim, kvd = hp->n_kv_head * hp->head_dim;
    char name[96];
    m->norm_f32 = calloc((size_t)(2 * hp->n_layer + 1) * hp->dim, sizeof(float));
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->norm_f32 || !m->layers) return kv_fail(err, "out of memory");

    const gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return kv_fail(err, "missing tensor token_embd.weight");
    m->hp.n_vocab = (int)(emb->ne[1] > INT32_MAX ? 0 : emb->ne[1]);
    if (m->hp.n_vocab < 1) return kv_fail(err, "token_embd.weight has a bad vocabulary size");
    if (load_weight(g, "token_embd.weight", hp->dim, hp->n_vocab, &m->tok_embd, err)) return -1;
    if (load_norm(m, "output_norm.weight", 2 * hp->n_layer, &m->output_norm, err)) return -1;
    if (gguf_find_tensor(g, "output.weight")) {
        if (load_weight(g, "output.weight", hp->dim, hp->n_vocab, &m->output, err)) return -1;
    } else {
        m->output = m->tok_embd;
        m->hp.tied_output = true;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        layer_weights *L = &m->layers[l];
#define BLK(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, l), name)
        if (load_norm(m, BLK("attn_norm.weight"), 2 * l, &L->attn_norm, err) ||
            load_norm(m, BLK("ffn_norm.weight"), 2 * l + 1, &L->ffn_norm, err) ||
            load_weight(g, BLK("attn_q.weight"), hp->dim, qd, &L->wq, err) ||
            load_weight(g, BLK("attn_k.weight"), hp->dim, kvd, &L->wk, err) ||
            load_weight(g, BLK("attn_v.weight"), hp->dim, kvd, &L->wv, err) ||
            load_weight(g, BLK("attn_output.weight"), qd, hp->dim, &L->wo, err) ||
            load_weight(g, BLK("ffn_gate.weight"), hp->dim, hp->ffn_dim, &L->w_gate, err) ||
            load_weight(g, BLK("ffn_up.weight"), hp->dim, hp->ffn_dim, &L->w_up, err) ||
            load_weight(g, BLK("ffn_down.weight"), hp->ffn_dim, hp->dim, &L->w_down, err))
            return -1;
#undef BLK
    }
    return 0;
}

/* ---------------------------------------------------------------- RoPE table */

/* inv_freq[i] = base^(-2i / n_rot), divided by the linear factor, or by Llama 3's per-frequency
 * factors: the file's rope_freqs.weight when present (llama.cpp writes it for Llama 3.1+), else
 * computed from the scaling metadata (Meta's llama3 rope scaling, low/high frequency bands). */
static int build_rope(model *m, kv_error *err) {
    const model_hparams *hp = &m->hp;
    int half = hp->n_rot / 2;
    m->rope.n_rot = hp->n_rot;
    m->rope.inv_freq = malloc(sizeof(float) * (size_t)half);
    if (!m->rope.inv_freq) return kv_fail(err, "out of memory");
    const gguf_tensor *ff = gguf_find_tensor(m->gguf, "rope_freqs.weight");
    if (ff && (ff->type != TENSOR_TYPE_F32 || ff->ne[0] != half || ff->ne[1] != 1))
        return kv_fail(err, "rope_freqs.weight must be F32 [%d]", half);
    for (int i = 0; i < half; i++) {
        double f = pow(hp->rope_base, -2.0 * i / hp->n_rot);
        if (ff) {
            float d = ((const float *)ff->data)[i];
            if (!(d > 0) || !isfinite(d)) return kv_fail(err, "rope_freqs.weight[%d] = %g", i, d);
            f /= d;
        } else if (hp->rope_scaling_type == ROPE_SCALING_LINEAR) {
            f /= hp->rope_factor;
        } else if (hp->rope_scaling_type == ROPE_SCALING_LLAMA3) {
            double lo = hp->rope_low_freq_factor, hi = hp->rope_high_freq_factor;
            double orig = hp->rope_orig_ctx;
            double wavelen = 2 * M_PI / f;
            if (wavelen > orig / lo) {
                f /= hp->rope_factor;
            } else if (wavelen >= orig / hi) {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                f = (1 - smooth) * f / hp->rope_factor + smooth * f;
            }
        }
        m->rope.inv_freq[i] = (float)f;
    }
    return 0;
}

/* ---------------------------------------------------------------- identity */

/* Bytes sampled from each tensor's data for the identity: its first and last page and one page
 * per MiB between. */
#define IDENTITY_PAGE 4096
#define IDENTITY_STRIDE (1u << 20)

/* SHA-256 over what fixes the meaning of KV: architecture, hyperparameters, every tensor's name,
 * type, shape and data offset, samples of every tensor's data, and the KV dtype (f16). The
 * context cache keys chunks by it, so a different model, including a fine-tune with the same
 * layout, never reads this one's KV from a shared cache directory. The samples (about 1/256 of
 * the data, and both ends of every tensor) catch any real change of weights at a cost of a few
 * milliseconds per GiB; hashing every byte would add seconds to the start of large models. */
static int compute_identity(model *m, kv_error *err) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return kv_fail(err, "SHA-256 unavailable");
    }
    const char tag[] = "kvserve-model-v2 llama kv=f16";
    EVP_DigestUpdate(ctx, tag, sizeof tag);
    EVP_DigestUpdate(ctx, &m->hp, sizeof m->hp);
    for (int64_t i = 0; i < gguf_tensor_count(m->gguf); i++) {
        const gguf_tensor *t = gguf_tensor_at(m->gguf, i);
        EVP_DigestUpdate(ctx, t->name, strlen(t->name) + 1);
        int32_t type = t->type;
        EVP_DigestUpdate(ctx, &type, sizeof type);
        EVP_DigestUpdate(ctx, t->ne, sizeof t->ne);
        EVP_DigestUpdate(ctx, &t->offset, sizeof t->offset);
        const uint8_t *d = t->data;
        for (size_t off = 0; off < t->size; off += IDENTITY_STRIDE) {
            size_t n = t->size - off < IDENTITY_PAGE ? t->size - off : IDENTITY_PAGE;
            EVP_DigestUpdate(ctx, d + off, n);
        }
        if (t->size > IDENTITY_PAGE)
            EVP_DigestUpdate(ctx, d + t->size - IDENTITY_PAGE, IDENTITY_PAGE);
    }
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx, m->identity, &len);
    EVP_MD_CTX_free(ctx);
    return 0;
}

/* ---------------------------------------------------------------- load */

model *model_load(const char *path, const model_load_opts *opts, kv_error *err) {
    model *m = calloc(1, sizeof *m);
    if (!m) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    m->path = strdup(path);
    m->gguf = gguf_open(path, err);
    if (!m->gguf || !m->path) goto fail;
    if (load_hparams(m->gguf, &m->hp, err) || load_weights(m, err)) goto fail;
    if (m->hp.rope_scaling_type == ROPE_SCALING_LLAMA3 &&
        !gguf_find_tensor(m->gguf, "rope_freqs.weight")) {
        m->hp.rope_low_freq_factor = 1.0f;
        m->hp.rope_high_freq_factor = 4.0f;
        m->hp.rope_orig_ctx = 8192;
        if (get_float(m->gguf, "llama.rope.scaling.low_freq_factor", &m->hp.rope_low_freq_factor,
                      err) ||
            get_float(m->gguf, "llama.rope.scaling.high_freq_factor", &m->hp.rope_high_freq_factor,
                      err) ||
            get_int(m->gguf, "llama.rope.scaling.original_context_length", 1, 1 << 24,
                    &m->hp.rope_orig_ctx, false, err))
            goto fail;
        if (!(m->hp.rope_high_freq_factor > m->hp.rope_low_freq_factor)) {
            kv_fail(err, "llama3 rope: high_freq_factor must exceed low_freq_factor");
            goto fail;
        }
    }
    if (build_rope(m, err)) goto fail;
    m->tok = tokenizer_create(m->gguf, err);
    if (!m->tok) {
        kv_fail_wrap(err, "tokenizer");
        goto fail;
    }
    if (tokenizer_n_vocab(m->tok) > m->hp.n_vocab) {
        kv_fail(err, "tokenizer has %d tokens but token_embd.weight only %d rows",
                tokenizer_n_vocab(m->tok), m->hp.n_vocab);
        goto fail;
    }
    if (opts && opts->chat_template) {
        if (chat_template_from_name(opts->chat_template, &m->chat) != 0) {
            kv_fail(err, "unknown chat template '%s' (" CHAT_TEMPLATE_NAMES ")",
                    opts->chat_template);
            goto fail;
        }
    } else {
        const char *src = NULL;
        size_t len = 0;
        if (gguf_has_key(m->gguf, "tokenizer.chat_template") &&
            gguf_get_str(m->gguf, "tokenizer.chat_template", &src, &len, err) != 0)
            goto fail;
        if (src) chat_template_detect(src, len, &m->chat);
        if (m->chat.kind == CHAT_TEMPLATE_UNKNOWN) {
            /* Documented fallback: ChatML is the most widely understood format. */
            log_warn("%s: chat template %s; using ChatML (override with --chat-template)", path,
                     src ? "not recognised" : "absent");
            chat_template_from_name("chatml", &m->chat);
        }
    }
    log_info("%s: chat template %s, tool format %s", path, chat_template_name(m->chat.kind),
             chat_tools_format_name(m->chat.tools));
    /* a control token that marks the format's calls decodes to its text, so the answer's
     * grammar can ask for it and its parser sees it */
    for (const char *const *mk = chat_tools_markers(m->chat.tools); *mk; mk++)
        if (tokenizer_render_as_text(m->tok, *mk) >= 0)
            log_info("%s: control token %s decodes as text (tool calls)", path, *mk);
    const char *name;
    size_t name_len;
    if (gguf_has_key(m->gguf, "general.name") &&
        gguf_get_str(m->gguf, "general.name", &name, &name_len, NULL) == 0)
        m->name = strndup(name, name_len > 256 ? 256 : name_len);
    else
        m->name = strdup(strrchr(path, '/') ? strrchr(path, '/') + 1 : path);
    if (!m->name || compute_identity(m, err)) goto fail;
    return m;
fail:
    model_free(m);
    return NULL;
}

void model_free(model *m) {
    if (!m) return;
    tokenizer_destroy(m->tok);
    chat_template_free(&m->chat);
    gguf_close(m->gguf);
    free(m->rope.inv_freq);
    free(m->norm_f32);
    free(m->layers);
    free(m->name);
    free(m->path);
    free(m);
}

size_t model_weight_bytes(const model *m) {
    size_t total = 0;
    for (int64_t i = 0; i < gguf_tensor_count(m->gguf); i++)
        total += gguf_tensor_at(m->gguf, i)->size;
    return total;
}

size_t model_kv_bytes_per_token(const model *m) {
    return (size_t)m->hp.n_layer * 2 * m->hp.n_kv_head * m->hp.head_dim * 2;
}

#include "server/cli_common.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- options */

int cli_parse_int(const char *opt, const char *s, long long lo, long long hi, long long *out,
                  kv_error *err) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        return kv_fail(err, "%s: '%s' is not an integer in [%lld, %lld]", opt, s, lo, hi);
    *out = v;
    return 0;
}

int cli_parse_float(const char *opt, const char *s, double lo, double hi, double *out,
                    kv_error *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v) || v < lo || v > hi)
        return kv_fail(err, "%s: '%s' is not a number in [%g, %g]", opt, s, lo, hi);
    *out = v;
    return 0;
}

/* Stores one option's value (NULL for a flag) where its row says. */
static int opt_store(const cli_opt *o, const char *value, kv_error *err) {
    char name[64];
    long long ll;
    double d;
    snprintf(name, sizeof name, "--%s", o->name);
    switch (o->type) {
    case CLI_OPT_FLAG:
        *(bool *)o->dst = true;
        return 0;
    case CLI_OPT_STRING:
        *(const char **)o->dst = value;
        return 0;
    case CLI_OPT_INT:
        if (cli_parse_int(name, value, o->min, o->max, &ll, err)) return -1;
        *(int *)o->dst = (int)ll;
        return 0;
    case CLI_OPT_INT64:
        if (cli_parse_int(name, value, o->min, o->max, &ll, err)) return -1;
        *(int64_t *)o->dst = ll;
        return 0;
    case CLI_OPT_FLOAT:
        if (cli_parse_float(name, value, o->fmin, o->fmax, &d, err)) return -1;
        *(float *)o->dst = (float)d;
        return 0;
    case CLI_OPT_FN:
        return o->fn(o->dst, value, err);
    }
    return kv_fail(err, "%s: unknown option type %d", name, (int)o->type);
}

/* getopt_long does the scanning (its messages name argv[0], the command, for an unknown option
 * or a missing value); the table gives it long options with values 256 + row and short ones as
 * themselves. */
int cli_parse(const cli_command *cmd, int argc, char **argv) {
    int n = cmd->n_opts, rc = -1, c;
    struct option *longopts = calloc((size_t)n + 2, sizeof *longopts);
    char *shortopts = malloc(2 * (size_t)n + 2);
    bool *seen = calloc((size_t)n + 1, sizeof *seen);
    if (!longopts || !shortopts || !seen) {
        fprintf(stderr, "%s: out of memory\n", cmd->name);
        rc = 2;
        goto done;
    }
    char *sp = shortopts;
    for (int i = 0; i < n; i++) {
        const cli_opt *o = &cmd->opts[i];
        int has_arg = o->type == CLI_OPT_FLAG ? no_argument : required_argument;
        longopts[i] = (struct option){o->name, has_arg, NULL, 256 + i};
        if (o->short_name) {
            *sp++ = o->short_name;
            if (has_arg == required_argument) *sp++ = ':';
        }
    }
    longopts[n] = (struct option){"help", no_argument, NULL, 'h'};
    *sp++ = 'h';
    *sp = '\0';

    char *argv0 = argv[0];
    argv[0] = (char *)cmd->name;
    optind = 0; /* glibc: start afresh (a second parse in one process, as in the unit tests) */
    while (rc < 0 && (c = getopt_long(argc, argv, shortopts, longopts, NULL)) != -1) {
        int i = -1;
        if (c >= 256) {
            i = c - 256;
        } else if (c != 'h' && c != '?') {
            for (int k = 0; k < n && i < 0; k++)
                if (cmd->opts[k].short_name == c) i = k;
        }
        if (c == 'h') {
            cmd->usage(stdout);
            rc = 0;
        } else if (i < 0) { /* getopt_long said why */
            cmd->usage(stderr);
            rc = 2;
        } else {
            kv_error err = {{0}};
            if (opt_store(&cmd->opts[i], optarg, &err)) {
                fprintf(stderr, "%s: %s\n", cmd->name, err.msg);
                rc = 2;
            }
            seen[i] = true;
        }
    }
    argv[0] = argv0;
    if (rc >= 0) goto done;
    if (optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", cmd->name, argv[optind]);
        cmd->usage(stderr);
        rc = 2;
        goto done;
    }
    for (int i = 0; i < n; i++) {
        const cli_opt *o = &cmd->opts[i];
        if (o->required && !seen[i]) {
            if (o->short_name)
                fprintf(stderr, "%s: need -%c %s\n", cmd->name, o->short_name, o->required);
            else
                fprintf(stderr, "%s: need --%s %s\n", cmd->name, o->name, o->required);
            cmd->usage(stderr);
            rc = 2;
            goto done;
        }
    }
done:
    free(longopts);
    free(shortopts);
    free(seen);
    return rc;
}

/* ---------------------------------------------------------------- files */

char *cli_read_file(const char *path, kv_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        kv_fail(err, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0) break;
        if (cap - len - 1 == 0) {
            char *b2 = realloc(buf, cap * 2);
            if (!b2) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b2;
            cap *= 2;
        }
    }
    bool bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        kv_fail(err, "cannot read %s", path);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

int cli_parse_device(void *dst, const char *value, kv_error *err) {
    if (strcmp(value, "auto") && strcmp(value, "cuda") && strcmp(value, "cpu"))
        return kv_fail(err, "--device: '%s' is not auto, cuda or cpu", value);
    *(const char **)dst = value;
    return 0;
}

int cli_parse_simd(void *dst, const char *value, kv_error *err) {
    simd_level l;
    if (simd_level_from_name(value, &l) != 0)
        return kv_fail(err, "--simd: '%s' is not auto, avx512, avx2 or scalar", value);
    *(const char **)dst = value;
    return 0;
}

int cli_simd_apply(const char *name, kv_error *err) {
    simd_level want;
    if (!name) name = "auto";
    if (simd_level_from_name(name, &want) != 0)
        return kv_fail(err, "simd: '%s' is not auto, avx512, avx2 or scalar", name);
    simd_level got = simd_level_set(want);
    if (got != want)
        log_warn("simd %s: this CPU runs %s at most; using %s", name, simd_level_name(got),
                 simd_level_name(got));
    return 0;
}

/* ---------------------------------------------------------------- single-sequence engine */

int engine_single_load(engine_single *e, const cli_model_opts *o, kv_error *err) {
    memset(e, 0, sizeof *e);
    kv_seq_init(&e->seq);
    e->threads = o->threads;
    e->precise = o->precise;
    e->device = o->device ? o->device : "cpu";
    if (cli_simd_apply(o->simd, err) != 0) return -1;
    model_load_opts lo = {.chat_template = o->chat_template};
    return (e->m = model_load(o->path, &lo, err)) ? 0 : -1;
}

int engine_single_start(engine_single *e, int ctx, kv_error *err) {
    const model *m = e->m;
    e->ctx = ctx;
    if (!(e->b = backend_create(e->device, e->threads, err))) return -1;
    backend_set_precision(e->b, e->precise ? MATMUL_PRECISION_F32 : MATMUL_PRECISION_Q8);
    /* Round the pool up to whole blocks so ctx slots always fit. */
    if (!(e->pool = kv_pool_create(e->b, m, ((int64_t)ctx + 15) / 16 * 16, 16, err))) return -1;
    if (!(e->fwd = forward_ctx_create(m, e->b, e->pool, ENGINE_SLICE, 1, err))) return -1;
    if (!(e->logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab)))
        return kv_fail(err, "out of memory");
    log_info("model %s: %d layers, %.1f MiB of weights mapped from %s; backend %s, %d threads, "
             "SIMD %s, %s matmuls; KV pool %lld tokens (%.1f MiB)",
             m->name, m->hp.n_layer, model_weight_bytes(m) / 1048576.0, m->path, backend_name(e->b),
             e->threads, simd_level_name(simd_level_get()), e->precise ? "f32" : "8-bit activation",
             (long long)(kv_pool_total_blocks(e->pool) * kv_pool_layout(e->pool)->block_tokens),
             kv_pool_total_blocks(e->pool) * kv_layout_block_bytes(kv_pool_layout(e->pool)) /
                 1048576.0);
    return 0;
}

void engine_single_free(engine_single *e) {
    if (e->pool) kv_seq_release(e->pool, &e->seq);
    forward_ctx_destroy(e->fwd);
    kv_pool_destroy(e->pool);
    backend_destroy(e->b);
    free(e->logits);
    free(e->rows);
    model_free(e->m);
    memset(e, 0, sizeof *e);
}

static int forward_slices(engine_single *e, const int32_t *ids, int n, bool decode, kv_error *err) {
    int32_t pos[ENGINE_SLICE];
    if (e->seq.n_tokens + n > e->ctx)
        return kv_fail(err, "%d tokens do not fit the context of %d (%d in use)", n, e->ctx,
                       e->seq.n_tokens);
    for (int done = 0; done < n;) {
        int len = n - done < ENGINE_SLICE ? n - done : ENGINE_SLICE;
        int start = e->seq.n_tokens;
        if (kv_seq_reserve(e->pool, &e->seq, start + len, err)) return -1;
        for (int i = 0; i < len; i++) pos[i] = start + i;
        batch_seq bs = {.seq = &e->seq,
                        .n_tok = len,
                        .tokens = ids + done,
                        .pos = pos,
                        .kv_start = start,
                        .decode = decode};
        if (model_forward(e->fwd, &bs, 1, e->hooks, e->logits, err) < 0) return -1;
        done += len;
    }
    return 0;
}

int engine_single_prefill(engine_single *e, const int32_t *ids, int n, kv_error *err) {
    return forward_slices(e, ids, n, false, err);
}

int engine_single_decode(engine_single *e, int32_t id, kv_error *err) {
    return forward_slices(e, &id, 1, true, err);
}

int engine_single_write_kv(engine_single *e, int n, int chunk, const float *kv, kv_error *err) {
    const kv_layout *lay = kv_pool_layout(e->pool);
    size_t nc = (size_t)lay->n_kv_head * (size_t)lay->head_dim;
    size_t ce = (size_t)lay->n_layer * 2 * (size_t)chunk * nc;
    kv_seq_truncate(e->pool, &e->seq, 0);
    if (n > e->ctx) return kv_fail(err, "%d tokens do not fit the context of %d", n, e->ctx);
    if (kv_seq_reserve(e->pool, &e->seq, n, err)) return -1;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)chunk);
    if (!slots) return kv_fail(err, "out of memory");
    for (int k = 0; k * chunk < n; k++) {
        int len = n - k * chunk < chunk ? n - k * chunk : chunk;
        for (int t = 0; t < len; t++) slots[t] = k * chunk + t;
        for (int l = 0; l < lay->n_layer; l++) {
            const float *base = kv + (size_t)k * ce + (size_t)l * 2 * (size_t)chunk * nc;
            backend_kv_store(e->b, kv_pool_memory(e->pool), lay, l, e->seq.blocks, slots, len, base,
                             base + (size_t)chunk * nc);
        }
    }
    free(slots);
    e->seq.n_tokens = n;
    return 0;
}

int engine_single_rows(engine_single *e, const int32_t *tokens, int from, int to, engine_row_fn fn,
                       void *ud, kv_error *err) {
    size_t n_vocab = (size_t)e->m->hp.n_vocab;
    int32_t pos[ENGINE_ROWS];
    if (to > e->ctx) return kv_fail(err, "%d tokens do not fit the context of %d", to, e->ctx);
    if (!e->rows && !(e->rows = malloc(sizeof(float) * ENGINE_ROWS * n_vocab)))
        return kv_fail(err, "out of memory");
    kv_seq_truncate(e->pool, &e->seq, from);
    for (int s = from; s < to; s += ENGINE_ROWS) {
        int len = to - s < ENGINE_ROWS ? to - s : ENGINE_ROWS;
        if (kv_seq_reserve(e->pool, &e->seq, s + len, err)) return -1;
        for (int i = 0; i < len; i++) pos[i] = s + i;
        batch_seq bs = {.seq = &e->seq,
                        .n_tok = len,
                        .tokens = tokens + s,
                        .pos = pos,
                        .kv_start = s,
                        .all_logits = true};
        if (model_forward(e->fwd, &bs, 1, NULL, e->rows, err) != len) return -1;
        for (int i = 0; i < len; i++)
            if (fn(ud, s + i - from, e->rows + (size_t)i * n_vocab))
                return kv_fail(err, "stopped at row %d", s + i - from);
    }
    return 0;
}

void engine_single_reset(engine_single *e) { kv_seq_truncate(e->pool, &e->seq, 0); }

int engine_single_read_kv(engine_single *e, int n_chunks, int chunk, float *out, kv_error *err) {
    const kv_layout *l = kv_pool_layout(e->pool);
    size_t row = (size_t)chunk * (size_t)l->n_kv_head * (size_t)l->head_dim;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)chunk);
    if (!slots) return kv_fail(err, "out of memory");
    for (int k = 0; k < n_chunks; k++) {
        for (int t = 0; t < chunk; t++) slots[t] = k * chunk + t;
        for (int layer = 0; layer < l->n_layer; layer++)
            for (int kv = 0; kv < 2; kv++) {
                float *dst =
                    out + (((size_t)k * (size_t)l->n_layer + (size_t)layer) * 2 + kv) * row;
                backend_kv_load(e->b, kv_pool_memory(e->pool), l, layer, kv, e->seq.blocks, slots,
                                chunk, dst);
            }
    }
    free(slots);
    return 0;
}

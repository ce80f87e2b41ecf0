/* libFuzzer target for the PML parser (cache/schema/pml.c): every input is parsed as it is (a copy
 * of exactly size bytes, so ASan sees any read past it) under tight limits. A refusal must name its
 * line and column; an accepted document must be a tree PML allows (checked here by walking it:
 * kinds where they may be, names that are names, parameters with lengths in range, no more nodes or
 * depth than the limits). Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/schema/pml.h"

static int walk(const pml_node *n, bool prompt, int depth, const pml_limits *lim, int *count) {
    if (depth > lim->max_depth) abort();
    for (int i = 0; i < n->n_kids; i++) {
        const pml_node *k = n->kids[i];
        if (++*count > lim->max_nodes) abort();
        switch (k->kind) {
        case PML_TEXT:
            if (!k->text || strlen(k->text) != k->len || k->len == 0 || n->kind == PML_UNION)
                abort();
            break;
        case PML_MODULE:
            if (!k->name || !pml_name_ok(k->name) || (!prompt && pml_reserved(k->name))) abort();
            for (int a = 0; a < k->n_args; a++)
                if (!prompt || !pml_name_ok(k->args[2 * a]) || !k->args[2 * a + 1]) abort();
            break;
        case PML_PARAM:
            if (prompt || k->length < 1 || k->length > lim->max_param_len || k->n_kids) abort();
            break;
        case PML_UNION:
            if (prompt || k->n_kids == 0) abort();
            for (int j = 0; j < k->n_kids; j++)
                if (k->kids[j]->kind != PML_MODULE) abort();
            break;
        case PML_ROLE:
            if (k->role > PML_ROLE_ASSISTANT) abort();
            break;
        default:
            abort();
        }
        walk(k, prompt, depth + 1, lim, count);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pml_limits lim;
    pml_limits_default(&lim);
    lim.max_bytes = 1 << 16;
    lim.max_depth = 16;
    lim.max_nodes = 512;
    lim.max_param_len = 64;
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    kv_error err = {{0}};
    pml_doc *d = pml_parse(buf, size, &lim, &err);
    if (!d) {
        if (strncmp(err.msg, "line ", 5) != 0 && !strstr(err.msg, "bytes")) abort();
    } else {
        int count = 0;
        if (!d->name || !pml_name_ok(d->name)) abort();
        walk(&d->root, d->prompt, 1, &lim, &count);
        pml_free(d);
    }
    free(buf);
    return 0;
}

/* What the routers that spread load over several kvserve instances ask of each one (README,
 * "Behind a router"). SGLang's router (sglang-router) registers an instance through GET
 * /server_info and /model_info (falling back to /get_server_info and /get_model_info on a 404)
 * and, under its power_of_two policy, polls GET /get_load; vLLM's router (vllm-router) polls
 * GET /get_load as well, in a shape of its own (--get-load-format), and lists the models of
 * GET /v1/models. Both take an instance out once GET /health stops answering 200, which it does
 * as soon as a drain starts (routes.c). The values are the server's own: its model id, its
 * limits, and the engine's gauges as the engine thread last published them. */
#include <string.h>

#include "server/api/handlers.h"

/* GET /server_info (and /get_server_info): the fields of SGLang's answer that sglang-router
 * 0.3.2 reads (its ServerInfo). served_model_name names the model in the router's /v1/models;
 * model_id is what other versions read (never with its alias "model" beside it: serde refuses
 * a field given twice, and the router would then read nothing). model_path is left out on
 * purpose: the router loads a tokenizer from it, a Hugging Face lookup of a local GGUF path
 * that can only fail. One process serves one batch: tp_size and dp_size are 1. The limits:
 * sequences decoding at once, the KV pool in tokens, the prompt tokens one step prefills, the
 * context of a sequence and the requests that may wait. */
http_result router_server_info(server *s, const http_call *c, http_out *out) {
    (void)c;
    const char *id = s->model_ids[0];
    json_t *v =
        json_pack("{s:s,s:s,s:i,s:i,s:i,s:I,s:i,s:i,s:i,s:b}", "served_model_name", id, "model_id",
                  id, "tp_size", 1, "dp_size", 1, "max_running_requests", engine_max_seqs(s->eng),
                  "max_total_tokens", (json_int_t)engine_kv_pool_tokens(s->eng),
                  "max_prefill_tokens", s->cfg->prefill_chunk, "context_length", s->ctx,
                  "max_queued_requests", s->cfg->max_queue, "is_embedding", 0);
    http_reply_json(&out->reply, 200, v);
    return HTTP_REPLIED;
}

/* GET /model_info (and /get_model_info): SGLang's ModelInfo, of which sglang-router 0.3.2
 * labels the worker with model_type (the GGUF's general.architecture). Generation and
 * embeddings both run here; neither images nor audio are understood. */
http_result router_model_info(server *s, const http_call *c, http_out *out) {
    (void)c;
    const char *arch = NULL;
    size_t len = 0;
    char type[64] = "";
    if (gguf_get_str(s->m->gguf, "general.architecture", &arch, &len, NULL) == 0)
        snprintf(type, sizeof type, "%.*s", (int)(len < sizeof type ? len : sizeof type - 1), arch);
    json_t *v =
        json_pack("{s:s,s:b,s:b,s:b,s:i,s:i}", "served_model_name", s->model_ids[0],
                  "is_generation", 1, "has_image_understanding", 0, "has_audio_understanding", 0,
                  "max_context_length", s->ctx, "vocab_size", s->m->hp.n_vocab);
    if (type[0]) json_object_set_new(v, "model_type", json_string(type));
    http_reply_json(&out->reply, 200, v);
    return HTTP_REPLIED;
}

/* GET /get_load. sglang-router 0.3.2 sums num_tokens over a JSON array (one entry per data
 * parallel rank, SGLang's shape; kvserve has one); vllm-router 0.1.17 reads "load" of an object.
 * The one path cannot answer both, so --get-load-format picks the shape. num_reqs counts the
 * requests running and waiting (SGLang's meaning), num_tokens the KV tokens the running
 * sequences hold (cached blocks no sequence uses are free to take, so not counted); "load"
 * counts requests, as vllm-router's own in-flight count it is added to does. */
http_result router_get_load(server *s, const http_call *c, http_out *out) {
    (void)c;
    metrics_engine g;
    metrics_get_engine(s->mx, &g);
    int reqs = g.running + g.waiting;
    json_t *v = json_pack("{s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:i}", "dp_rank", 0, "num_reqs", reqs,
                          "num_waiting_reqs", g.waiting, "num_running_reqs", g.running,
                          "num_tokens", (json_int_t)(g.kv_blocks_used * g.kv_block_tokens),
                          "kv_blocks_used", (json_int_t)g.kv_blocks_used, "kv_blocks_total",
                          (json_int_t)g.kv_blocks_total, "kv_block_tokens", g.kv_block_tokens);
    if (!strcmp(s->cfg->get_load_format, "vllm")) {
        json_object_set_new(v, "load", json_integer(reqs));
    } else {
        json_t *ranks = json_array();
        json_array_append_new(ranks, v);
        v = ranks;
    }
    http_reply_json(&out->reply, 200, v);
    return HTTP_REPLIED;
}

/* What one request may have an HTTP thread tokenize: text that cannot fit the context is refused
 * before it is tokenized (handlers.h's server_text_limit). Below every route that tokenizes, so
 * none of them calls another's file for it. */
#include "server/api/api_impl.h"
#include "server/api/handlers.h"

int server_check_text(const server *s, size_t len, const char *param, api_error *err) {
    size_t limit = server_text_limit(s);
    if (len <= limit) return 0;
    return api_fail(err, 400, "invalid_request_error", "context_length_exceeded", param,
                    "This model's maximum context length is %d tokens, and no token spans more "
                    "than %zu bytes: text over %zu bytes cannot fit, and yours has %zu. Please "
                    "reduce the length of the %s.",
                    s->ctx, tokenizer_max_token_len(s->m->tok), limit, len, param);
}

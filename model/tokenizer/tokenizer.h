/* Tokenizer built from GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2" model, with the
 * pre-tokenizers named by tokenizer.ggml.pre) and SentencePiece ("llama" model, byte fallback).
 * Reference behaviour: llama.cpp's llama-vocab, which wrote these GGUF fields. */
#ifndef KVSERVE_TOKENIZER_H
#define KVSERVE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"
#include "util/util.h"

typedef struct tokenizer tokenizer;

tokenizer *tokenizer_create(const gguf_file *g, kv_error *err);
void tokenizer_destroy(tokenizer *t);

int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t); /* -1 when the model has none */
int32_t tokenizer_eos(const tokenizer *t);
bool tokenizer_add_bos(const tokenizer *t); /* tokenizer.ggml.add_bos_token (or model default) */
bool tokenizer_add_eos(const tokenizer *t); /* tokenizer.ggml.add_eos_token (default false) */
/* End of generation: EOS, EOT, <|im_end|>, <|eot_id|>, <|end_of_text|> and the like. */
bool tokenizer_is_eog(const tokenizer *t, int32_t id);
/* Token text as stored in the vocabulary (NUL-terminated), NULL when out of range. */
const char *tokenizer_token_text(const tokenizer *t, int32_t id);
/* 0 when a and b give every id the same token (text, type, end of generation, special ids),
 * so one model's ids mean the same to the other (a draft model's); else -1 with err naming the
 * first difference. */
int tokenizer_same_vocab(const tokenizer *a, const tokenizer *b, kv_error *err);
/* Id of a vocabulary entry by exact text (e.g. "<|im_end|>"), -1 when absent. */
int32_t tokenizer_find(const tokenizer *t, const char *text);
/* Makes the control token whose text is exactly `text` decode to that text from now on, as a
 * normal token does (a tool format's call marker: Mistral's [TOOL_CALLS] is a control token, and
 * the answer's grammar and parser must see it); encoding is unchanged. Returns its id, or -1
 * when the vocabulary has no such control token (or memory runs out). Not thread-safe: call at
 * load, before any decoding. */
int32_t tokenizer_render_as_text(tokenizer *t, const char *text);

/* Encodes len bytes of text (must be valid UTF-8; invalid sequences are an error). With
 * parse_special, control/special token texts in the input ("<|im_start|>") become their ids;
 * without, they are tokenized as plain text. add_bos prepends BOS when the model has one.
 * Returns the token count and a malloc'd array in *out (caller frees), or -1 with err. */
int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t **out, kv_error *err);

/* The bytes a token decodes to (byte-level BPE un-mapped, SentencePiece "▁" to space, <0xXX> to
 * the byte). Control tokens (and the unknown token) decode to "" unless render_special; unused
 * tokens always do, as in llama_token_to_piece. Writes at most cap bytes and returns the full
 * length (like snprintf, without a NUL), or -1 for an out-of-range id. */
int tokenizer_token_bytes(const tokenizer *t, int32_t id, bool render_special, char *buf,
                          size_t cap);
/* Where each of ids[0..n) begins in the text they encode (starts[i], in bytes), when their bytes
 * (control tokens rendered) are that text exactly, the BOS the encoding added (added_bos: ids[0],
 * at 0, spanning nothing) aside. False when they are not (SentencePiece's added leading space,
 * a normalizer): then there is no such map. */
bool tokenizer_token_starts(const tokenizer *t, const int32_t *ids, int n, bool added_bos,
                            const char *text, size_t len, size_t *starts);
/* The longest tokenizer_token_bytes of any token (render_special). */
size_t tokenizer_max_token_len(const tokenizer *t);

/* Decodes a whole sequence: the tokens' bytes concatenated (SentencePiece: without the leading
 * space of the first non-empty piece, the one encoding added), with every invalid UTF-8
 * sequence as U+FFFD, so the result is what detok_push over the ids plus detok_flush give when
 * render_special is false. Returns a malloc'd NUL-terminated string and its length in *out_len,
 * or NULL with err for an out-of-range id. */
char *tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool render_special,
                       size_t *out_len, kv_error *err);

/* One token's bytes as valid UTF-8 (bytes that are not become U+FFFD), without any leading-space
 * stripping: a token's text for display, e.g. in logprobs. malloc'd and NUL-terminated; NULL
 * for an out-of-range id or when out of memory. */
char *tokenizer_piece_utf8(const tokenizer *t, int32_t id, bool render_special, size_t *out_len);

/* Incremental detokenization: push tokens one by one; only complete UTF-8 sequences come out,
 * so a multi-byte character split over tokens is never emitted in halves. A byte sequence that
 * can never become valid UTF-8 is emitted as U+FFFD. */
typedef struct detok_state {
    uint8_t pending[8];
    int n_pending;
    bool at_start; /* SentencePiece: strip the leading space of the first token */
} detok_state;

void detok_init(detok_state *s);
/* Appends the text that became complete to buf (at most cap bytes; returns bytes written or -1
 * when cap is too small or id is out of range; the state is then unchanged). Control tokens
 * emit nothing. Every invalid byte can become a 3-byte U+FFFD, so 16 + 3 times
 * tokenizer_max_token_len(t) bytes always suffice; 64 plus the longest token is enough when
 * the pieces are valid UTF-8 on their own, the usual case. */
int detok_push(const tokenizer *t, detok_state *s, int32_t id, char *buf, size_t cap);
/* Flushes what is left (incomplete bytes become U+FFFD). */
int detok_flush(detok_state *s, char *buf, size_t cap);

#endif

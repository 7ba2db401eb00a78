/* Pastry inferlet API for core wasm guests (C, wasm32-freestanding).
 *
 * A C subset of wit/pastry.wit, imported from module "pastry" (host side:
 * src/pastry/runtime/wasm_core.py). Every value is an int32; strings and lists are
 * (pointer, length) in the guest's memory. Calls return -1 on failure; pastry_error()
 * copies the message. Queued calls return a pending id at once; pastry_wait(p) blocks
 * (the host suspends the guest) until it has completed; take / take_dist consume it.
 *
 * The inferlet exports `int run(void)`: 0 on success, the result text being what it
 * last gave pastry_set_result; non-zero for an error, whose message is that text if
 * set, else the last error message.
 *
 * Build: python -m ziglang cc --target=wasm32-freestanding -O2 -nostdlib \
 *            -Wl,--no-entry -o greedy.wasm greedy.c
 */
#ifndef PASTRY_H
#define PASTRY_H

#include <stdint.h>

#define PASTRY_IMPORT(name) __attribute__((import_module("pastry"), import_name(#name)))
#define PASTRY_EXPORT(name) __attribute__((export_name(#name)))

/* runtime */
PASTRY_IMPORT(arg_count) int32_t pastry_arg_count(void);
/* Copies argument i (at most cap bytes, no NUL); returns its full length. */
PASTRY_IMPORT(arg) int32_t pastry_arg(int32_t i, char *buf, int32_t cap);
PASTRY_IMPORT(send) int32_t pastry_send(const char *msg, int32_t len);
PASTRY_IMPORT(receive) int32_t pastry_receive(void); /* pending: take_text not provided */
PASTRY_IMPORT(set_result) int32_t pastry_set_result(const char *text, int32_t len);
PASTRY_IMPORT(error) int32_t pastry_error(char *buf, int32_t cap);
/* A queue on `model` (len 0: the first available model). */
PASTRY_IMPORT(create_queue) int32_t pastry_create_queue(const char *model, int32_t len);

/* allocate */
PASTRY_IMPORT(get_kv_page_size) int32_t pastry_get_kv_page_size(int32_t q);
PASTRY_IMPORT(alloc_kvpages) int32_t pastry_alloc_kvpages(int32_t q, int32_t n, uint32_t *out);
PASTRY_IMPORT(alloc_embeds) int32_t pastry_alloc_embeds(int32_t q, int32_t n, uint32_t *out);

/* queued calls: return a pending id */
PASTRY_IMPORT(embed_txt)
int32_t pastry_embed_txt(int32_t q, const uint32_t *tokens, const uint32_t *positions,
                         const uint32_t *embeds, int32_t n);
PASTRY_IMPORT(forward)
int32_t pastry_forward(int32_t q, const uint32_t *in_kv, int32_t n_in_kv, int32_t in_kv_last_len,
                       const uint32_t *in_embeds, int32_t n_in_embeds, const uint32_t *out_kv,
                       int32_t n_out_kv, int32_t out_kv_offset, const uint32_t *out_embeds,
                       int32_t n_out_embeds);
PASTRY_IMPORT(get_next_dist) int32_t pastry_get_next_dist(int32_t q, int32_t embed, int32_t k);
PASTRY_IMPORT(sample_greedy) int32_t pastry_sample_greedy(int32_t q, int32_t embed);

/* waiting */
PASTRY_IMPORT(wait) int32_t pastry_wait(int32_t pending);
/* Outcome of a completed call: the token of sample_greedy, 0 for calls without a value. */
PASTRY_IMPORT(take) int32_t pastry_take(int32_t pending);
/* Outcome of get_next_dist: writes up to cap ids and probabilities, returns the count. */
PASTRY_IMPORT(take_dist)
int32_t pastry_take_dist(int32_t pending, uint32_t *ids, float *probs, int32_t cap);

#endif

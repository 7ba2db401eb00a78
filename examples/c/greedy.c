/* Greedy text completion as a C inferlet (the GREEDY_LOOP of tests/test_inferlets.py).
 *
 * args[0]: prompt token ids, comma-separated; args[1]: number of new tokens.
 * Result: the generated token ids, comma-separated.
 */
#include "pastry.h"

#define MAX_TOKENS 4096
#define TOP_K 256

static char text[16 * MAX_TOKENS];
static uint32_t tokens[MAX_TOKENS], positions[MAX_TOKENS], out[MAX_TOKENS];
static uint32_t kv[MAX_TOKENS], emb[MAX_TOKENS + 1];
static uint32_t ids[TOP_K];
static float probs[TOP_K];

static int fail(const char *msg) {
    int n = 0;
    while (msg[n]) n++;
    pastry_set_result(msg, n);
    return 1;
}

/* Wait for a pending call and consume its (empty) outcome. */
static int finish(int32_t p) {
    if (p < 0 || pastry_wait(p) < 0 || pastry_take(p) < 0) return -1;
    return 0;
}

PASTRY_EXPORT(run) int run(void) {
    if (pastry_arg_count() != 2) return fail("usage: <token,token,...> <n_new>");
    int32_t len = pastry_arg(0, text, sizeof text);
    if (len < 0 || len > (int32_t)sizeof text) return 1;
    int n = 0;
    uint32_t v = 0;
    int digits = 0;
    for (int i = 0; i <= len; i++) {
        char c = i < len ? text[i] : ',';
        if (c >= '0' && c <= '9') {
            v = v * 10 + (uint32_t)(c - '0');
            digits = 1;
        } else if (c == ',' && digits) {
            if (n >= MAX_TOKENS) return fail("prompt too long");
            tokens[n++] = v;
            v = 0;
            digits = 0;
        }
    }
    len = pastry_arg(1, text, sizeof text);
    int n_new = 0;
    for (int i = 0; i < len; i++) n_new = n_new * 10 + (text[i] - '0');
    if (n == 0 || n + n_new > MAX_TOKENS) return fail("bad prompt or length");

    int32_t q = pastry_create_queue(0, 0);
    if (q < 0) return 1;
    int32_t ps = pastry_get_kv_page_size(q);
    if (ps <= 0) return 1;
    int n_pages = (n + n_new + ps - 1) / ps;
    if (pastry_alloc_kvpages(q, n_pages, kv) < 0) return 1;
    if (pastry_alloc_embeds(q, n + 1, emb) < 0) return 1;
    for (int i = 0; i < n; i++) positions[i] = (uint32_t)i;

    if (finish(pastry_embed_txt(q, tokens, positions, emb, n)) < 0) return 1;
    if (finish(pastry_forward(q, 0, 0, 0, emb, n, kv, n_pages, 0, &emb[n], 1)) < 0) return 1;

    int length = n;
    for (int step = 0; step < n_new; step++) {
        int32_t p = pastry_get_next_dist(q, (int32_t)emb[n], TOP_K);
        if (p < 0 || pastry_wait(p) < 0) return 1;
        int32_t k = pastry_take_dist(p, ids, probs, TOP_K);
        if (k <= 0) return 1;
        int best = 0; /* the first maximum, like probs.index(max(probs)) */
        for (int i = 1; i < k; i++)
            if (probs[i] > probs[best]) best = i;
        uint32_t tok = ids[best];
        out[step] = tok;
        uint32_t pos = (uint32_t)length;
        if (finish(pastry_embed_txt(q, &tok, &pos, emb, 1)) < 0) return 1;
        int n_ctx = (length + ps - 1) / ps;
        int last = length - (n_ctx - 1) * ps;
        if (finish(pastry_forward(q, kv, n_ctx, last, emb, 1, &kv[length / ps],
                                  n_pages - length / ps, length % ps, &emb[n], 1)) < 0)
            return 1;
        length++;
    }

    /* the result: comma-separated ids */
    int w = 0;
    for (int i = 0; i < n_new; i++) {
        char digit[12];
        int nd = 0;
        uint32_t t = out[i];
        do {
            digit[nd++] = (char)('0' + t % 10);
            t /= 10;
        } while (t);
        if (i) text[w++] = ',';
        while (nd) text[w++] = digit[--nd];
    }
    pastry_set_result(text, w);
    return 0;
}

/* tiergate engine: a whole decode step in one native call (included at the end of tg_kernels.c, whose
 * kernels it runs).
 *
 *   tg_decode_layers   every layer of a step of B rows, each one new token of a sequence (a decode step: one
 *                      row per sequence; a prefill or verify: several rows sharing a sequence, each with its own
 *                      context, all rows' K/V written before any row attends): RMSNorm (+ the
 *                      previous sub-block's residual), packed QKV, RoPE + cache write, paged attention,
 *                      packed o_proj, RMSNorm (+ residual), the MoE block or a dense SwiGLU MLP; then the
 *                      model's norm
 *   tg_decode_step     the same from token ids and positions: the embedding rows, the RoPE rows of a
 *                      per-position table, the cache slots from the block tables, the layers, the final norm
 *                      and the LM head, so a decode step makes one call from Python
 *
 * Threads. A small model's products are each below the size at which the per-op kernels split work
 * (clamp_threads), yet a decode step of them is not: the demo model's step is ~3.4M multiply-adds in
 * ~40 products. So a step whose total work is worth splitting runs as ONE parallel region (one thread team
 * for the whole step, as llama.cpp's graph compute does): every product gives each thread its share of the
 * output panels, the per-row steps (RoPE, attention, SwiGLU) split the rows, the one-thread steps
 * (RMSNorm, MoE routing) run on thread 0, and barriers order the stages (about ten per layer). Each output
 * element is still computed by one thread in the same order, so results do not depend on the thread
 * count. A step of fewer sequences than threads whose attention alone is worth splitting (long contexts)
 * runs instead as a team of one whose kernels each open their own region, as the per-op path does, since
 * the team splits attention by sequence.
 */

typedef struct {
    const float *input_norm, *post_norm;
    float eps;
    int fmt;                                  /* the format of every packed weight below (TG_F32 ...) */
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *o_bias; /* packed, bias or NULL */
    int64_t n_q, n_kv, head_dim, window;      /* window 0: none */
    float scale;
    const float *router;          /* MoE: router row-major, experts packed */
    const void *gate_up, *down;
    int64_t num_experts, moe_intermediate;
    int normalize;
    const void *mlp_gate_up; /* dense MLP (router NULL) */
    const float *mlp_gate_up_bias;
    const void *mlp_down;
    const float *mlp_down_bias;
    int64_t mlp_intermediate;
    float *k_cache, *v_cache;
} tg_layer;

int tg_layer_size(void) { return (int)sizeof(tg_layer); }

/* What tg_decode_step reads besides the layers. */
typedef struct {
    const float *embed;           /* [vocab, hidden] token embedding, row-major fp32 */
    const float *cos, *sin;       /* [n_positions, rope_dim]: the model's RoPE values per position */
    int64_t n_positions, rope_dim;
    const float *final_norm;
    float final_eps;
    int lm_fmt;                   /* the LM head's format (TG_F32 ...) */
    const void *lm_head;          /* packed [vocab, hidden], no bias */
    int64_t vocab, hidden;
} tg_model;

int tg_model_size(void) { return (int)sizeof(tg_model); }

/* One decode step's batch for tg_decode_step: B sequences, each feeding tokens[b] at positions[b] over its
 * cache blocks tables[b * width ...] (int64, -1 padded), with k_per_token[b] experts (NULL: k_max for all);
 * argmax (NULL: not wanted) receives each row's greedy token. */
typedef struct {
    int64_t B, width, block_size;
    const int64_t *tokens, *positions, *tables;
    int k_max;
    const int32_t *k_per_token;
    int64_t *argmax;
} tg_batch;

int tg_batch_size(void) { return (int)sizeof(tg_batch); }

/* One decode step's inputs, outputs and scratch, shared by the threads that run it. */
typedef struct {
    const tg_layer *layers;
    int n_layers, k_max;
    float *h; /* [B, H] residual stream, updated in place */
    int64_t B, H, width, block_size;
    const float *cos, *sin; /* [B, D] */
    const int64_t *slots, *tables, *lens;
    const int32_t *k_per_token;
    const float *final_norm;
    float final_eps;
    float *out; /* [B, H] final-normed hidden states */
    const void *lm_head; /* NULL: no LM head (tg_decode_layers) */
    int lm_fmt;
    int64_t vocab;
    float *logits; /* [B, vocab] */
    /* scratch */
    float *x, *delta, *wide, *q, *att, *mlp, *xd;
    int8_t *xq;
    moe_work moe;
    int has_moe, failed;
    char *base;
} step_args;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The step's scratch (one allocation, plus the MoE block's); 0 or -1. */
static int step_alloc(step_args *a) {
    const int64_t B = a->B, H = a->H;
    int64_t widest = H, q_widest = H, mlp_widest = 0, in_widest = H, E = 0, I = 0;
    int quant = a->lm_head != NULL && is_quantized(a->lm_fmt);
    for (int l = 0; l < a->n_layers; l++) {
        const tg_layer *L = &a->layers[l];
        widest = max64(widest, (L->n_q + 2 * L->n_kv) * L->head_dim);
        q_widest = max64(q_widest, L->n_q * L->head_dim);
        mlp_widest = max64(mlp_widest, 2 * L->mlp_intermediate);
        in_widest = max64(in_widest, max64(L->n_q * L->head_dim, L->mlp_intermediate));
        quant |= is_quantized(L->fmt);
        if (L->router) {
            E = max64(E, L->num_experts);
            I = max64(I, L->moe_intermediate);
        }
    }
    a->base = NULL;
    a->has_moe = E > 0;
    for (int pass = 0; pass < 2; pass++) {
        size_t at = 0;
        carve(a->base, &at, sizeof(float) * B * H, (void **)&a->x);
        carve(a->base, &at, sizeof(float) * B * H, (void **)&a->delta);
        carve(a->base, &at, sizeof(float) * B * widest, (void **)&a->wide);
        carve(a->base, &at, sizeof(float) * B * q_widest, (void **)&a->q);
        carve(a->base, &at, sizeof(float) * B * q_widest, (void **)&a->att);
        carve(a->base, &at, sizeof(float) * B * mlp_widest, (void **)&a->mlp);
        /* block formats: each product's input rows, quantized once */
        carve(a->base, &at, quant ? sizeof(float) * B * (in_widest / QK) : 0, (void **)&a->xd);
        carve(a->base, &at, quant ? (size_t)(B * in_widest) : 0, (void **)&a->xq);
        if (pass == 0 && !(a->base = malloc(at))) return -1;
    }
    if (a->has_moe && moe_alloc(&a->moe, B, H, E, I, a->k_max, quant)) {
        free(a->base);
        return -1;
    }
    return 0;
}

static void step_free(step_args *a) {
    if (a->has_moe) free(a->moe.base);
    free(a->base);
}

/* How to run the step: 1 (a team of one: every kernel on this thread), n > 1 (a team of n), or 0 (a team of
 * one whose kernels each split their own work over nthreads: few sequences with long contexts). */
static int step_threads(const step_args *a, int nthreads) {
    if (nthreads <= 1) return 1;
    const int64_t B = a->B, H = a->H;
    int64_t work = a->lm_head ? B * a->vocab * H : 0, max_len = 0, attention = 0;
    for (int64_t b = 0; b < B; b++) max_len = max64(max_len, a->lens[b]);
    for (int l = 0; l < a->n_layers; l++) {
        const tg_layer *L = &a->layers[l];
        const int64_t q_w = L->n_q * L->head_dim;
        work += B * ((L->n_q + 2 * L->n_kv) * L->head_dim * H + q_w * H);
        work += L->router ? B * a->k_max * 3 * H * L->moe_intermediate : B * 3 * H * L->mlp_intermediate;
        attention = max64(attention, max_len * q_w * 2); /* one sequence's, as tg_paged_decode counts it */
    }
    if (clamp_threads(nthreads, work) == 1) return 1;
    if (B < nthreads && clamp_threads(nthreads, attention) > 1) return 0;
    return nthreads;
}

/* y [M, N] = x . W^T (+ bias), x given quantized (xd, xq) for the block formats: in a team, this thread's
 * share of the output panels; in a team of one, the whole product, split over `kthreads` by tg_linear's own
 * rule (which quantizes x again, the same way). */
static int step_linear(const float *x, const float *xd, const int8_t *xq, int64_t M, int64_t K, int64_t ldx,
                       const void *W, int fmt, int64_t N, const float *bias, float *y, int tid, int nth,
                       int kthreads) {
    if (nth == 1 && kthreads > 1) return tg_linear(x, M, K, ldx, W, fmt, N, bias, y, N, kthreads);
    int64_t b, e;
    share(panels_of(N), tid, nth, &b, &e);
    return gemm_any(x, xd, xq, M, K, ldx, W, fmt, N, bias, y, N, b, e);
}

static void step_failed(step_args *a) {
#pragma omp atomic write
    a->failed = 1;
}

/* The routed experts of this layer into a->delta: shared by the team, or in a region of their own. */
static void step_moe(step_args *a, const tg_layer *L, int tid, int nth, int kthreads) {
    if (nth == 1 && kthreads > 1) {
        int n = clamp_threads(kthreads, a->moe.assignments * 3 * a->H * a->moe.I);
#pragma omp parallel num_threads(n)
        moe_experts(&a->moe, L->gate_up, L->down, L->fmt, a->delta, THREAD_ID(), THREADS());
    } else {
        moe_experts(&a->moe, L->gate_up, L->down, L->fmt, a->delta, tid, nth);
    }
}

/* One layer, run by thread `tid` of a team of `nth` (see the file comment); rows [r0, r1) are this thread's. */
static void step_layer(step_args *a, int l, int tid, int nth, int kthreads, int64_t r0, int64_t r1) {
    const tg_layer *L = &a->layers[l];
    const int64_t B = a->B, H = a->H, D = L->head_dim, q_w = L->n_q * D, qkv_w = (L->n_q + 2 * L->n_kv) * D;
    const int quant = is_quantized(L->fmt);
    if (tid == 0) {
        tg_add_rmsnorm(a->h, l ? a->delta : NULL, L->input_norm, B, H, L->eps, a->x);
        if (quant) tg_quantize_rows_q8(a->x, B, H, H, a->xd, a->xq);
    }
#pragma omp barrier
    if (step_linear(a->x, a->xd, a->xq, B, H, H, L->qkv, L->fmt, qkv_w, L->qkv_bias, a->wide, tid, nth, kthreads))
        step_failed(a);
#pragma omp barrier
    if (r1 > r0)
        tg_rope_write_kv(a->wide + r0 * qkv_w, r1 - r0, L->n_q, L->n_kv, D, a->cos + r0 * D, a->sin + r0 * D,
                         a->q + r0 * q_w, L->k_cache, L->v_cache, a->slots + r0);
#pragma omp barrier /* every row's K/V is in the cache before any row attends (rows may share a sequence) */
    if (nth > 1) { /* the team shares the (row, KV head) pairs in turn: a prefill's rows have contexts 1 .. n */
        if (paged_decode_share(a->q, L->k_cache, L->v_cache, a->tables, a->width, a->lens, B, L->n_q, L->n_kv, D,
                               a->block_size, L->scale, L->window, a->att, tid, nth))
            step_failed(a);
        if (quant) {
#pragma omp barrier
            if (r1 > r0)
                tg_quantize_rows_q8(a->att + r0 * q_w, r1 - r0, q_w, q_w, a->xd + r0 * (q_w / QK), a->xq + r0 * q_w);
        }
    } else if (r1 > r0) {
        if (tg_paged_decode(a->q + r0 * q_w, L->k_cache, L->v_cache, a->tables + r0 * a->width, a->width,
                            a->lens + r0, r1 - r0, L->n_q, L->n_kv, D, a->block_size, L->scale, L->window,
                            a->att + r0 * q_w, kthreads))
            step_failed(a);
        if (quant)
            tg_quantize_rows_q8(a->att + r0 * q_w, r1 - r0, q_w, q_w, a->xd + r0 * (q_w / QK), a->xq + r0 * q_w);
    }
#pragma omp barrier
    if (step_linear(a->att, a->xd, a->xq, B, q_w, q_w, L->o, L->fmt, H, L->o_bias, a->delta, tid, nth, kthreads))
        step_failed(a);
#pragma omp barrier
    if (tid == 0) {
        tg_add_rmsnorm(a->h, a->delta, L->post_norm, B, H, L->eps, a->x);
        if (L->router) {
            a->moe.E = L->num_experts;
            a->moe.I = L->moe_intermediate;
            moe_route(&a->moe, a->x, B, L->router, a->k_per_token, L->normalize);
        } else if (quant) {
            tg_quantize_rows_q8(a->x, B, H, H, a->xd, a->xq);
        }
    }
#pragma omp barrier
    if (L->router) {
        step_moe(a, L, tid, nth, kthreads);
    } else {
        const int64_t I = L->mlp_intermediate;
        if (step_linear(a->x, a->xd, a->xq, B, H, H, L->mlp_gate_up, L->fmt, 2 * I, L->mlp_gate_up_bias, a->mlp,
                        tid, nth, kthreads))
            step_failed(a);
#pragma omp barrier
        for (int64_t b = r0; b < r1; b++) { /* mlp[:, :I] = silu(gate) * up */
            float *g = a->mlp + b * 2 * I;
            silu_mul(g, I);
            if (quant) quantize_row_q8(g, I, a->xd + b * (I / QK), a->xq + b * I);
        }
#pragma omp barrier
        if (step_linear(a->mlp, a->xd, a->xq, B, I, 2 * I, L->mlp_down, L->fmt, H, L->mlp_down_bias, a->delta, tid,
                        nth, kthreads))
            step_failed(a);
    }
#pragma omp barrier
}

/* Every layer, the final norm and (if any) the LM head, by thread `tid` of a team of `nth`. */
static void step_run(step_args *a, int tid, int nth, int kthreads) {
    int64_t r0, r1;
    share(a->B, tid, nth, &r0, &r1);
    for (int l = 0; l < a->n_layers; l++) step_layer(a, l, tid, nth, kthreads, r0, r1);
    if (tid == 0) {
        tg_add_rmsnorm(a->h, a->n_layers ? a->delta : NULL, a->final_norm, a->B, a->H, a->final_eps, a->out);
        if (a->lm_head && is_quantized(a->lm_fmt)) tg_quantize_rows_q8(a->out, a->B, a->H, a->H, a->xd, a->xq);
    }
    if (a->lm_head) {
#pragma omp barrier
        if (step_linear(a->out, a->xd, a->xq, a->B, a->H, a->H, a->lm_head, a->lm_fmt, a->vocab, NULL, a->logits,
                        tid, nth, kthreads))
            step_failed(a);
    }
}

/* Allocate, pick the threads (step_threads), run, free; 0 or -1 (memory). */
static int step_go(step_args *a, int nthreads) {
    if (a->B <= 0) return 0;
    if (step_alloc(a)) return -1;
    a->failed = 0;
    int nth = step_threads(a, nthreads);
    if (nth <= 1) {
        step_run(a, 0, 1, nth == 0 ? nthreads : 1);
    } else {
#pragma omp parallel num_threads(nth)
        step_run(a, THREAD_ID(), THREADS(), 1);
    }
    const int failed = a->failed || (a->has_moe && a->moe.failed);
    step_free(a);
    return failed ? -1 : 0;
}

int tg_decode_layers(const tg_layer *layers, int n_layers, float *h, int64_t B, int64_t H, const float *cos,
                     const float *sin, const int64_t *slots, const int64_t *tables, int64_t width,
                     const int64_t *lens, int64_t block_size, int k_max, const int32_t *k_per_token,
                     const float *final_norm, float final_eps, float *out, int nthreads) {
    step_args a = {.layers = layers, .n_layers = n_layers, .k_max = k_max, .h = h, .B = B, .H = H, .width = width,
                   .block_size = block_size, .cos = cos, .sin = sin, .slots = slots, .tables = tables, .lens = lens,
                   .k_per_token = k_per_token, .final_norm = final_norm, .final_eps = final_eps, .out = out};
    return step_go(&a, nthreads);
}

/* The index of the first maximum of x[0:n] (n >= 1), or of the first NaN if there is one: torch.argmax's
 * answer, so a greedy token picked here is the one the sampler would pick from the logits. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float m = x[0];
#if TG_AVX512
    if (n >= 16) { /* no NaN: the largest value, then the first element equal to it */
        __m512 mx = _mm512_loadu_ps(x);
        __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n && !nan; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        if (nan) {
            i = 0;
        } else {
            m = _mm512_reduce_max_ps(mx);
            for (int64_t j = i; j < n; j++) {
                if (x[j] != x[j]) return j;
                m = x[j] > m ? x[j] : m;
            }
            const __m512 mv = _mm512_set1_ps(m);
            for (i = 0; i + 16 <= n; i += 16) {
                __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
                if (eq) return i + __builtin_ctz(eq);
            }
            for (; i < n; i++)
                if (x[i] == m) return i;
            return 0; /* not reached */
        }
    }
#endif
    int64_t best = 0;
    m = x[0];
    for (i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > m) m = x[i], best = i;
    }
    return best;
}

/* out[r] = argmax_row of row r of x [rows, n] (n >= 1). */
void tg_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

/* A decode step of `batch` (token ids, positions, block tables): the logits [B, vocab]. Returns 0, -1
 * (memory), or -2 when a token, a position or a table entry is out of range (nothing is written then). */
int tg_decode_step(const tg_model *model, const tg_layer *layers, int n_layers, const tg_batch *batch, float *logits,
                   int nthreads) {
    const int64_t B = batch->B, width = batch->width, block_size = batch->block_size;
    const int64_t *tokens = batch->tokens, *positions = batch->positions, *tables = batch->tables;
    if (B <= 0) return 0;
    const int64_t H = model->hidden, D = model->rope_dim;
    for (int64_t b = 0; b < B; b++) {
        int64_t t = tokens[b], p = positions[b];
        if (t < 0 || t >= model->vocab || p < 0 || p >= model->n_positions || p / block_size >= width ||
            tables[b * width + p / block_size] < 0)
            return -2;
    }
    float *h = malloc(sizeof(float) * B * (2 * H + 2 * D)), *out = h + B * H, *cos = out + B * H, *sin = cos + B * D;
    int64_t *slots = malloc(sizeof(int64_t) * 2 * B), *lens = slots + B;
    int rc = -1;
    if (h && slots) {
        for (int64_t b = 0; b < B; b++) {
            int64_t p = positions[b];
            memcpy(h + b * H, model->embed + tokens[b] * H, sizeof(float) * H);
            memcpy(cos + b * D, model->cos + p * D, sizeof(float) * D);
            memcpy(sin + b * D, model->sin + p * D, sizeof(float) * D);
            slots[b] = tables[b * width + p / block_size] * block_size + p % block_size;
            lens[b] = p + 1;
        }
        step_args a = {.layers = layers, .n_layers = n_layers, .k_max = batch->k_max, .h = h, .B = B, .H = H,
                       .width = width, .block_size = block_size, .cos = cos, .sin = sin, .slots = slots,
                       .tables = tables, .lens = lens, .k_per_token = batch->k_per_token,
                       .final_norm = model->final_norm,
                       .final_eps = model->final_eps, .out = out, .lm_head = model->lm_head, .lm_fmt = model->lm_fmt,
                       .vocab = model->vocab, .logits = logits};
        rc = step_go(&a, nthreads);
        if (rc == 0 && batch->argmax) tg_argmax_rows(logits, B, model->vocab, batch->argmax);
    }
    free(h);
    free(slots);
    return rc;
}

/* tiergate engine: fp32 CPU kernels for the memory-bound decode path.
 *
 * Batch-1 and small-batch decode read every weight byte once per step and do little arithmetic with it,
 * so speed is the rate at which weights stream from memory. Weights are repacked once (tg_pack) into
 * 64-output panels stored front to back, which each step streams sequentially for up to MR tokens at a
 * time with the outputs held in registers; larger batches tile the tokens over the same panel. The
 * kernels fuse what a decode step does around those products:
 *
 *   tg_linear          y[M, N] = x[M, K] . W[N, K]^T (+ bias), W packed (fp32/bf16 panels) or quantized
 *                      (Q8_0/Q4_0 blocks, activations quantized to int8 per block, int8 dot products)
 *   tg_moe             router GEMV, softmax, top-k (per-token k, optional renormalisation) and the
 *                      SwiGLU experts, each selected expert's weights read once for all its tokens
 *   tg_paged_decode    one query per sequence against its paged K/V cache (GQA, sliding window)
 *   tg_decode_layers,  a whole decode step in one call, on one thread team (tg_step.c, included at the end)
 *   tg_decode_step
 *
 * Work is split over output panels (linear, MoE) or (sequence, KV head) pairs (attention) with OpenMP,
 * linked against the same libgomp as PyTorch so both share one thread pool. Every kernel takes the
 * thread count to use; results do not depend on it (each output element is reduced by one thread in a
 * fixed order). Accumulation is fp32 throughout; sums are reassociated (16 lanes), so results differ
 * from PyTorch's by float rounding only.
 *
 * Built by engine/native/build.py with -O3 -march=native. Three code paths, by what the compiler targets:
 * AVX-512 (with VNNI for the quantized products where targeted); AVX2 + FMA (x86-64-v3: AMD EPYC before
 * Zen 4 and most cloud x86 without AVX-512, and the container image's portable build); plain C loops
 * otherwise. The portable loops are ~10x slower than either vector path (measured on an AVX2-only EPYC:
 * demo-model decode 177 -> 2,000 tok/s with the AVX2 kernels), so the vector paths are what to keep fast.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <sys/mman.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define TG_AVX512 1
#else
#define TG_AVX512 0
#endif
#if !TG_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define TG_AVX2 1 /* AVX2 + FMA without AVX-512 (x86-64-v3: most AMD EPYC/Ryzen before Zen 4, older Intel) */
#else
#define TG_AVX2 0
#endif

#define PANEL 64 /* outputs per packed panel: four 16-float vectors */
#define MR 6      /* tokens per register tile (6 x 4 accumulators + 4 weight vectors fit in 32 registers) */

int tg_abi_version(void) { return 14; }

/* Weight formats (`fmt` arguments and tg_layer.fmt): fp32 or bf16 64-output panels (tg_pack, tg_pack_bf16),
 * or ggml's row-major 32-element blocks, stored exactly as GGUF stores them (so a GGUF tensor is used as
 * it is): Q8_0 = fp16 scale d + 32 int8 (x = d q), Q4_0 = fp16 scale d + 16 bytes of nibbles (x = d (q - 8);
 * element j in the low nibble of byte j, element j + 16 in its high nibble). */
enum { TG_F32 = 0, TG_BF16 = 1, TG_Q8_0 = 2, TG_Q4_0 = 3 };
#define QK 32 /* elements per quantized block */

/* Ask for transparent huge pages on the 2 MiB-aligned part of [p, p + bytes) before it is first
 * written: a decode step streams hundreds of MB of weights, and with 4 KiB pages every 4 KiB costs a
 * TLB miss (measured here: 22 -> 32 GB/s for a batch-1 product). Returns 0, or the failing errno-ish
 * -1 when the kernel refuses (THP off): harmless, the pages are just small. */
int tg_advise_huge(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (end <= begin) return 0;
    return madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
    return -1;
#endif
}

int tg_has_avx512(void) { return TG_AVX512; }

static inline int64_t panels_of(int64_t n) { return (n + PANEL - 1) / PANEL; }

/* Packed layout of a row-major W[N, K]: P[N/64][K][64], P[p][k][j] = W[64p + j][k] (zero past N). A
 * decode step then streams each panel front to back, the access pattern hardware prefetchers serve best,
 * and the kernel keeps 64 outputs per token in registers with no horizontal reductions. */
void tg_pack(const float *W, int64_t N, int64_t K, int64_t ldw, float *P) {
    for (int64_t p = 0; p < panels_of(N); p++)
        for (int64_t k = 0; k < K; k++) {
            float *dst = P + (p * K + k) * PANEL;
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t n = p * PANEL + j;
                dst[j] = n < N ? W[n * ldw + k] : 0.0f;
            }
        }
}

/* The same layout with bf16 elements (round to nearest even): half the bytes to stream. Packing a
 * bf16 checkpoint this way is exact; the products still accumulate in fp32. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Where output j (0..63) of a panel row sits among its 64 bf16 elements: each 32-output half interleaves its
 * two 16-output quarters (outputs i and 16 + i share a 32-bit word, i in the low half), so a 64-byte load
 * gives both as fp32 vectors with one shift and one mask (no widening shuffle). */
static inline int64_t bf16_slot(int64_t j) { return (j & ~(int64_t)31) + 2 * (j & 15) + ((j >> 4) & 1); }

void tg_pack_bf16(const float *W, int64_t N, int64_t K, int64_t ldw, uint16_t *P) {
    for (int64_t p = 0; p < panels_of(N); p++)
        for (int64_t k = 0; k < K; k++) {
            uint16_t *dst = P + (p * K + k) * PANEL;
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t n = p * PANEL + j;
                dst[bf16_slot(j)] = to_bf16(n < N ? W[n * ldw + k] : 0.0f);
            }
        }
}

/* Software prefetch distance (bytes) for the weight streams: the hardware prefetchers stop at each 4 KiB
 * page, and a batch-1 product from DRAM ran at 8-13 GB/s on one core without it, 16-17 with it (this
 * machine; 0 turns it off). Each thread prefetches only within the weights it reads. */
/* Into which cache the software prefetches above bring the weights: L1 (_MM_HINT_T0, level 0) or L2 (T1, level
 * 1), chosen at run time (`tg_set_prefetch_level`; the engine measures both on the model's own weights when it
 * packs them, `engine.native.prefetch`), because which is faster depends on the machine, not on its instruction
 * set. One core's stream is bounded by how many misses it can have in flight, and a prefetch to L1 holds one of
 * L1's few fill buffers until its line arrives, where one to L2 does not: on Sapphire Rapids, fp32 panels from
 * DRAM on two cores, 4 / 16 tokens a product, 22.8 / 14.4 GB/s with T0 and 23.8 / 17.6 with T1; the bench MoE's
 * 16-stream decode 422-425 -> 463-479 tok/s. On an AMD EPYC Zen 5 (AVX-512, 2026-12-04, one core, interleaved
 * rounds) the other way: 4-token products from DRAM fp32 / bf16 / q8_0 / q4_0 1.14x / 1.03x / 1.09x / 1.05x
 * faster with T0, 6 tokens 1.07x / 1.07x / 1.12x. The compiled default: T1 with AVX-512 (the Xeon measurement),
 * T0 otherwise (the AVX2 kernels' prefetch was tuned with it on AMD EPYC machines). Every kernel that
 * prefetches reads the level once per call (`tg_pf_level`, into a local) and branches on it per prefetch, a
 * branch that always goes the same way (the same speed as the compiled hints, measured). Results do not depend
 * on it. */
#ifndef TG_PF_LEVEL
#define TG_PF_LEVEL TG_AVX512
#endif
static int tg_pf_level = TG_PF_LEVEL;
int tg_set_prefetch_level(int level) {
    const int before = tg_pf_level;
    if (level == 0 || level == 1) tg_pf_level = level;
    return before;
}
int tg_prefetch_level(void) { return tg_pf_level; }
#define PF_LINE(addr, level)                                                                                    \
    do {                                                                                                        \
        if (level)                                                                                              \
            _mm_prefetch((const char *)(addr), _MM_HINT_T1);                                                    \
        else                                                                                                    \
            _mm_prefetch((const char *)(addr), _MM_HINT_T0);                                                    \
    } while (0)
#ifndef TG_PF
#define TG_PF 8192
#endif
/* The one-token loop's prefetch distance (bytes; 0: none), set at run time (`tg_set_row_prefetch`): whether a
 * batch-1 product streams faster with it depends on the machine, not only on its instruction set. On one AVX2
 * EPYC it took a product from 8-13 to 16-17 GB/s (the note above); on another (2026-12-03) the same product
 * without it streamed 13% faster (19.4 against 17.1 GB/s, fp32 panels from DRAM on one core, interleaved
 * rounds), the hardware prefetchers then keeping more lines in flight than L1's fill buffers allow; bf16 panels
 * (half the bytes, a conversion per weight) showed no difference. On an AMD EPYC Zen 5 (AVX-512, 2026-12-04)
 * the AVX-512 one-token tile streamed 4-6% faster without it (fp32: 35.2 against 36.7 GB/s; bf16 3%). One
 * distance per panel format; the engine times both on the model's own weights when it packs them
 * (`engine.native.prefetch`). The AVX2 one-token loop and the AVX-512 one-token tile read it, starting at TG_PF
 * and at none (the Zen 5 measurement) respectively; the multi-token passes and tiles keep TG_PF. */
#define TG_ROW_PF (TG_AVX512 ? 0 : TG_PF)
static int64_t tg_row_pf[2] = {TG_ROW_PF, TG_ROW_PF}; /* by panel format: TG_F32, TG_BF16 */
int64_t tg_set_row_prefetch(int fmt, int64_t bytes) {
    if (fmt != TG_F32 && fmt != TG_BF16) return -1;
    const int64_t before = tg_row_pf[fmt];
    tg_row_pf[fmt] = bytes < 0 ? 0 : bytes & ~(int64_t)63;
    return before;
}
int64_t tg_row_prefetch(int fmt) { return fmt == TG_F32 || fmt == TG_BF16 ? tg_row_pf[fmt] : -1; }
#define ROW_PF(T) tg_row_pf[sizeof(T) == 2 ? TG_BF16 : TG_F32]

/* tile_<T>: y[m, 0:valid] = x[m, :K] . panel (+ bias[0:valid]) for m < mt, panel elements of type T. */
#if TG_AVX512
/* The four 16-output vectors of one panel row: fp32 as stored; bf16 (see bf16_slot) two 64-byte loads, the
 * low halves of each word shifted up, the high halves masked. */
static inline __attribute__((always_inline)) void load_row_f32(const float *p, __m512 w[4]) {
    for (int v = 0; v < 4; v++) w[v] = _mm512_load_ps(p + v * 16);
}
static inline __attribute__((always_inline)) void load_row_bf16(const uint16_t *p, __m512 w[4]) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < 2; h++) {
        const __m512i both = _mm512_load_si512((const void *)(p + h * 32));
        w[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
        w[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(both, high));
    }
}
/* More tokens than one tile holds (M > MR): the panel is read in blocks of KB_BYTES (32 fp32 rows, 64 bf16),
 * each block once from memory by the first tile of a chunk of up to MC tokens and then from L1 by the chunk's
 * other tiles, the accumulators waiting in `acc` between blocks; while those run from L1, they prefetch the
 * next block (the same row of it, into L2: L1 holds the block in use), so the memory stream does not stop
 * while the core computes. Before, each tile streamed the whole panel, the first from DRAM and the rest from
 * L2, one after the other. On an AMD EPYC Zen 5 (2026-12-04, one core, fp32 panels from DRAM, interleaved
 * rounds, bit-identical outputs) 7 / 8 / 12 / 16 / 24 tokens 1.14x / 1.17x / 1.27x / 1.29x / 1.16x faster
 * (16 tokens: 19.0 -> 24.5 GB/s, ~100 GFMA/s, the core's FMA peak); bf16 7 / 8 tokens 1.09x / 1.03x, 12-24
 * unchanged (their conversions make them compute-bound). Blocks of 64 / 128 / 32 KiB-equivalents and the next
 * block into L1 measured no better. Each output still sums its k in order, one FMA each: the same bits as one
 * tile. */
#define KB_BYTES 8192
#define MC 24
#define DEFINE_TILE(NAME, T, LOAD_ROW)                                                                          \
    /* tokens 0..mt-1 (<= MR) over kn rows of a panel, into acc_buf (first: from zero; pf: the tile that streams \
       the panel from memory) */                                                                                \
    static inline __attribute__((always_inline)) void NAME##_part(const float *x, int64_t ldx, const int mt,   \
                                                                   const T *p, int64_t kn, float acc_buf[][PANEL], \
                                                                   int first, int pf, const char *pf_end) {     \
        __m512 acc[MR][4];                                                                                      \
        for (int m = 0; m < MR; m++)                                                                            \
            for (int v = 0; v < 4; v++)                                                                         \
                acc[m][v] = (m < mt && !first) ? _mm512_loadu_ps(acc_buf[m] + 16 * v) : _mm512_setzero_ps();    \
        const int level = tg_pf_level;                                                                          \
        /* the tile streaming from memory: TG_PF ahead (one token: the distance set at run time, ROW_PF); the     \
           others: the next block */                                                                            \
        const int64_t ahead = pf ? (mt == 1 ? ROW_PF(T) : TG_PF) : KB_BYTES;                                   \
        for (int64_t k = 0; k < kn; k++) {                                                                      \
            __m512 w[4];                                                                                        \
            if (ahead && (const char *)p + ahead < pf_end)                                                      \
                for (int64_t i = 0; i < (int64_t)sizeof(T) * PANEL; i += 64) {                                  \
                    if (pf) PF_LINE((const char *)p + ahead + i, level);                                        \
                    else _mm_prefetch((const char *)p + ahead + i, _MM_HINT_T1);                                \
                }                                                                                               \
            LOAD_ROW(p, w);                                                                                     \
            for (int m = 0; m < MR; m++) {                                                                      \
                if (m < mt) {                                                                                   \
                    __m512 xb = _mm512_set1_ps(x[m * ldx + k]);                                                 \
                    for (int v = 0; v < 4; v++) acc[m][v] = _mm512_fmadd_ps(w[v], xb, acc[m][v]);               \
                }                                                                                               \
            }                                                                                                   \
            p += PANEL;                                                                                         \
        }                                                                                                       \
        for (int m = 0; m < MR; m++)                                                                            \
            if (m < mt)                                                                                         \
                for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc_buf[m] + 16 * v, acc[m][v]);                  \
    }                                                                                                           \
    /* y[m, 0:valid] = x[m, :K] . panel (+ bias[0:valid]) for m < mt (<= MR): one tile, the panel streamed once */ \
    static inline __attribute__((always_inline)) void NAME(const float *x, int64_t ldx, const int mt,          \
                                                            const T *p, int64_t K, const float *bias, float *y, \
                                                            int64_t ldy, int valid, const char *pf_end) {       \
        float acc[MR][PANEL];                                                                                   \
        NAME##_part(x, ldx, mt, p, K, acc, 1, 1, pf_end);                                                       \
        for (int v = 0; v < 4; v++) {                                                                           \
            int left = valid - v * 16;                                                                          \
            if (left <= 0) break;                                                                               \
            __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);                   \
            __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();                 \
            for (int m = 0; m < MR; m++)                                                                        \
                if (m < mt) {                                                                                   \
                    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(acc[m] + 16 * v), b);                      \
                    _mm512_mask_storeu_ps(y + m * ldy + v * 16, mask, sum);                                     \
                }                                                                                               \
        }                                                                                                       \
    }                                                                                                           \
    /* the same for any M: chunks of MC tokens, the panel in blocks (above) */                                  \
    static void NAME##_blocked(const float *x, int64_t ldx, int64_t M, const T *panel, int64_t K,               \
                               const float *bias, float *y, int64_t ldy, int valid, const char *pf_end) {       \
        float acc[MC][PANEL];                                                                                   \
        const int64_t kb = KB_BYTES / ((int64_t)sizeof(T) * PANEL);                                             \
        for (int64_t m0 = 0; m0 < M; m0 += MC) {                                                                \
            const int mc = (int)(M - m0 < MC ? M - m0 : MC);                                                    \
            const float *xm = x + m0 * ldx;                                                                     \
            for (int64_t k0 = 0; k0 < K; k0 += kb) {                                                            \
                const int64_t kn = K - k0 < kb ? K - k0 : kb;                                                   \
                const T *pk = panel + k0 * PANEL;                                                               \
                for (int g = 0; g < mc; g += MR) {                                                              \
                    const float *xg = xm + g * ldx + k0;                                                        \
                    const int first = k0 == 0, pf = g == 0;                                                     \
                    switch (mc - g < MR ? mc - g : MR) {                                                        \
                    case 1: NAME##_part(xg, ldx, 1, pk, kn, acc + g, first, pf, pf_end); break;                 \
                    case 2: NAME##_part(xg, ldx, 2, pk, kn, acc + g, first, pf, pf_end); break;                 \
                    case 3: NAME##_part(xg, ldx, 3, pk, kn, acc + g, first, pf, pf_end); break;                 \
                    case 4: NAME##_part(xg, ldx, 4, pk, kn, acc + g, first, pf, pf_end); break;                 \
                    case 5: NAME##_part(xg, ldx, 5, pk, kn, acc + g, first, pf, pf_end); break;                 \
                    default: NAME##_part(xg, ldx, MR, pk, kn, acc + g, first, pf, pf_end); break;               \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int m = 0; m < mc; m++)                                                                        \
                for (int j = 0; j < valid; j++)                                                                 \
                    y[(m0 + m) * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.0f);                                \
        }                                                                                                       \
    }
#elif TG_AVX2
/* Eight 8-output vectors per panel row (slot s). fp32: outputs 8s..8s+7 as stored. bf16: a 32-byte load holds
 * words 8c..8c+7 of the row (c = s / 2), whose low halves are outputs off..off+7 and high halves off+16..off+23
 * (see bf16_slot), so slot s = 2c + h is one shift or one mask of that load. */
static inline __attribute__((always_inline)) __m256 load8_f32(const float *p, int s) { return _mm256_loadu_ps(p + 8 * s); }
static inline int off8_f32(int s) { return 8 * s; }
static inline __attribute__((always_inline)) __m256 load8_bf16(const uint16_t *p, int s) {
    const __m256i both = _mm256_loadu_si256((const __m256i *)(p + 16 * (s >> 1)));
    return (s & 1) ? _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32((int)0xFFFF0000u)))
                   : _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
}
/* The same without a mask register (the high halves shifted down and back up), for the tiles that use the
 * other fifteen. */
static inline __attribute__((always_inline)) __m256 load8_bf16_nomask(const uint16_t *p, int s) {
    const __m256i both = _mm256_loadu_si256((const __m256i *)(p + 16 * (s >> 1)));
    return (s & 1) ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(both, 16), 16))
                   : _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
}
static inline int off8_bf16(int s) { return 32 * (s >> 2) + 8 * ((s >> 1) & 1) + 16 * (s & 1); }
/* 16 ymm registers. Three, five or six tokens go over each 16-output quarter of the panel (up to 12 accumulators,
 * two weight vectors, one broadcast: per k two weight loads and six broadcasts feed twelve FMAs), two tokens over
 * each 32-output half (8 accumulators), one token over the whole row (8). Four tokens go as two pairs over the
 * halves: the same loads per FMA as four over the quarters (six per eight), and each pass reads two adjacent
 * lines of a row instead of one: 4-token fp32 products from DRAM 8-10% faster on an AVX2 EPYC (2026-12-03, one
 * core, interleaved rounds: 10.9 against 10.0 GB/s). Three tokens over a half (12
 * accumulators, three broadcasts, a weight vector) leave the compiler no register to spare: it spilled an
 * accumulator, whose store and reload then ran every k (~1.6x the FMA time). The panel is read in blocks of KB
 * rows, each block once from L2 for a chunk of up to MC tokens and then from L1 by every pass over it. Between
 * blocks the accumulators wait in `acc` (slot order); each output still sums its k in order, one FMA each, so
 * every tile shape (and the one-token loop) gives the same bits. */
#define KB 64
#define MC 24
/* While a block is read from L1 by the passes after the first, up to NEXT_PASSES of them prefetch the next block
 * (each the row of it at their own k, every line, into L2), so the memory stream goes on while the core computes;
 * before, only the first pass prefetched (TG_PF ahead, inside the block), and the memory stood idle during the
 * others. Only for a thread's share of a product of at least TG_NEXT_MIN bytes: smaller ones are often in cache,
 * where the extra prefetches only cost (a 256 KiB panel in L2, 2-24 tokens: 6-29% slower with them). On an
 * AMD EPYC Zen 3 (AVX2, 2026-12-04, one core, 40 fp32 2560x768 matrices from DRAM, builds alternated round by
 * round, outputs bit-identical) 2 / 4 / 6 / 8 tokens 1.09-1.13x / 1.18-1.31x / 1.38-1.50x / 1.27-1.41x faster
 * (16: 0.98-1.19x, compute-bound), bf16 1.11x / 1.37x / 1.22x / 1.10x; the bench MoE's 16-stream decode 1.27x.
 * Only the second pass prefetching: 1.16x at 4 tokens against 1.30x (a prefetch dropped is not asked again);
 * one line per pass spread over the block 1.15x against 1.31x; two blocks ahead 1.14x against 1.29x.
 * The span's weight vectors are pinned to registers (an empty asm): gcc otherwise folded each fp32 load into every
 * token's FMA, so a pair over a half loaded each weight twice (ten loads for eight FMAs, more than this core's two
 * 256-bit loads a cycle feed): 2 / 4 tokens from L2 1.17x / 1.18x (26.2 -> 30.7, 30.4 -> 35.8 GMAC/s), from
 * DRAM and at 5+ tokens unchanged within the noise. */
#define TG_NEXT_MIN (1 << 20)
#define NEXT_PASSES 3
#define DEFINE_TILE(NAME, T, LOAD8, SPAN_LOAD8, OFF8) /* SPAN_LOAD8: a loader without a mask register */    \
    /* nt (<= 6) tokens over nv (2 or 4) 8-output slots from slot s0: per k the nv weight vectors, then each    \
       token's broadcast and its nv FMAs (nt * nv <= 12 accumulators). pf: 1 streams the panel (every line of   \
       the row TG_PF ahead), 2 prefetches the next block's row into L2 (above), 0 neither */                     \
    static inline __attribute__((always_inline)) void NAME##_span(const float *x, int64_t ldx, const int nt,    \
                                                                   const int nv, const int s0, const T *p,      \
                                                                   int64_t kn, float acc_buf[][PANEL],          \
                                                                   int first, int pf, const char *pf_end) {     \
        __m256 acc[6][4];                                                                                       \
        for (int m = 0; m < 6; m++)                                                                             \
            for (int v = 0; v < 4; v++)                                                                         \
                acc[m][v] = (m < nt && v < nv && !first) ? _mm256_loadu_ps(acc_buf[m] + 8 * (s0 + v))           \
                                                         : _mm256_setzero_ps();                                 \
        const int level = tg_pf_level;                                                                          \
        const int64_t ahead = pf == 1 ? TG_PF : (int64_t)sizeof(T) * PANEL * KB;                                \
        for (int64_t k = 0; k < kn; k++) {                                                                      \
            if (TG_PF && pf && (const char *)p + ahead < pf_end)                                                \
                for (int64_t i = 0; i < (int64_t)sizeof(T) * PANEL; i += 64) {                                  \
                    if (pf == 1) PF_LINE((const char *)p + ahead + i, level);                                   \
                    else _mm_prefetch((const char *)p + ahead + i, _MM_HINT_T1);                                \
                }                                                                                               \
            __m256 w[4];                                                                                        \
            for (int v = 0; v < 4; v++) w[v] = v < nv ? SPAN_LOAD8(p, s0 + v) : _mm256_setzero_ps();            \
            for (int v = 0; v < 4; v++)                                                                         \
                if (v < nv) __asm__("" : "+x"(w[v])); /* pinned to a register (the note above) */             \
            for (int m = 0; m < 6; m++)                                                                         \
                if (m < nt) {                                                                                   \
                    const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);                                           \
                    for (int v = 0; v < 4; v++)                                                                 \
                        if (v < nv) acc[m][v] = _mm256_fmadd_ps(w[v], xb, acc[m][v]);                           \
                }                                                                                               \
            p += PANEL;                                                                                         \
        }                                                                                                       \
        for (int m = 0; m < 6; m++)                                                                             \
            if (m < nt)                                                                                         \
                for (int v = 0; v < nv; v++) _mm256_storeu_ps(acc_buf[m] + 8 * (s0 + v), acc[m][v]);           \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void NAME##_row(const float *x, const T *p, int64_t kn,        \
                                                                  float *acc_buf, int first, int64_t pf,        \
                                                                  const char *pf_end) {                         \
        __m256 acc[8];                                                                                          \
        for (int v = 0; v < 8; v++) acc[v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_buf + 8 * v);   \
        const int level = tg_pf_level;                                                                          \
        for (int64_t k = 0; k < kn; k++) {                                                                      \
            if (pf && (const char *)p + pf < pf_end)                                                            \
                for (int64_t i = 0; i < (int64_t)sizeof(T) * PANEL; i += 64)                                    \
                    PF_LINE((const char *)p + pf + i, level);                                                   \
            const __m256 xb = _mm256_set1_ps(x[k]);                                                             \
            for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(LOAD8(p, v), xb, acc[v]);                     \
            p += PANEL;                                                                                         \
        }                                                                                                       \
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(acc_buf + 8 * v, acc[v]);                                 \
    }                                                                                                           \
    /* y[m, n0 + 0:valid] = x[m, :K] . panel (+ bias) for the M tokens, in chunks of MC */                     \
    static void NAME(const float *x, int64_t ldx, int64_t M, const T *panel, int64_t K, const float *bias,     \
                     float *y, int64_t ldy, int valid, const char *pf_end, int next) {                          \
        float acc[MC][PANEL];                                                                                   \
        for (int64_t m0 = 0; m0 < M; m0 += MC) {                                                                \
            const int mc = (int)(M - m0 < MC ? M - m0 : MC);                                                    \
            const float *xm = x + m0 * ldx;                                                                     \
            const int64_t kb = mc == 1 ? K : KB; /* one pass (one token) reads the panel once unblocked */      \
            for (int64_t k0 = 0; k0 < K; k0 += kb) {                                                            \
                const int64_t kn = K - k0 < kb ? K - k0 : kb;                                                   \
                const int first = k0 == 0;                                                                      \
                const T *pk = panel + k0 * PANEL;                                                               \
                int g = 0, pass = 0; /* passes after the first: up to NEXT_PASSES prefetch the next block */     \
                /* 3, 5 or 6 tokens: four 16-output quarters; 4 tokens: two pairs over the 32-output halves */ \
                for (; mc - g >= 3 && mc - g != 4; g += mc - g >= 6 ? 6 : mc - g) {                           \
                    const float *xg = xm + g * ldx + k0;                                                        \
                    for (int q = 0; q < 4; q++) {                                                               \
                        const int pf = pass == 0 ? 1 : next && pass <= NEXT_PASSES ? 2 : 0;                    \
                        pass++;                                                                                 \
                        switch (mc - g >= 6 ? 6 : mc - g) {                                                     \
                        case 3: NAME##_span(xg, ldx, 3, 2, 2 * q, pk, kn, acc + g, first, pf, pf_end); break;       \
                        case 4: NAME##_span(xg, ldx, 4, 2, 2 * q, pk, kn, acc + g, first, pf, pf_end); break;       \
                        case 5: NAME##_span(xg, ldx, 5, 2, 2 * q, pk, kn, acc + g, first, pf, pf_end); break;       \
                        default: NAME##_span(xg, ldx, 6, 2, 2 * q, pk, kn, acc + g, first, pf, pf_end); break;      \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
                for (; mc - g == 4 || mc - g == 2; g += 2) { /* two tokens (or two pairs): 32-output halves */ \
                    NAME##_span(xm + g * ldx + k0, ldx, 2, 4, 0, pk, kn, acc + g, first,                            \
                                pass == 0 ? 1 : next && pass <= NEXT_PASSES ? 2 : 0, pf_end);                    \
                    pass++;                                                                                     \
                    NAME##_span(xm + g * ldx + k0, ldx, 2, 4, 4, pk, kn, acc + g, first,                            \
                                next && pass <= NEXT_PASSES ? 2 : 0, pf_end);                                    \
                    pass++;                                                                                     \
                }                                                                                               \
                if (mc - g == 1) { /* one token: the whole row */                                               \
                    NAME##_row(xm + g * ldx + k0, pk, kn, acc[g], first, g == 0 ? ROW_PF(T) : 0, pf_end);        \
                }                                                                                               \
            }                                                                                                   \
            for (int m = 0; m < mc; m++)                                                                        \
                for (int s = 0; s < 8; s++) {                                                                   \
                    const int off = OFF8(s);                                                                    \
                    for (int l = 0; l < 8 && off + l < valid; l++)                                              \
                        y[(m0 + m) * ldy + off + l] = acc[m][8 * s + l] + (bias ? bias[off + l] : 0.0f);        \
                }                                                                                               \
        }                                                                                                       \
    }
DEFINE_TILE(tile_f32, float, load8_f32, load8_f32, off8_f32)
DEFINE_TILE(tile_bf16, uint16_t, load8_bf16, load8_bf16_nomask, off8_bf16)
#else
static inline float elem_f32(const float *p, int j) { return p[j]; }
static inline float elem_bf16(const uint16_t *p, int j) { return from_bf16(p[bf16_slot(j)]); }
#define DEFINE_TILE(NAME, T, ELEM)                                                                              \
    static inline void NAME(const float *x, int64_t ldx, const int mt, const T *p, int64_t K, const float *bias, \
                            float *y, int64_t ldy, int valid, const char *pf_end) {                             \
        (void)pf_end;                                                                                           \
        float acc[MR][PANEL];                                                                                   \
        for (int m = 0; m < mt; m++)                                                                            \
            for (int j = 0; j < PANEL; j++) acc[m][j] = 0.0f;                                                   \
        for (int64_t k = 0; k < K; k++) {                                                                       \
            for (int m = 0; m < mt; m++) {                                                                      \
                float xv = x[m * ldx + k];                                                                      \
                _Pragma("omp simd") for (int j = 0; j < PANEL; j++) acc[m][j] += ELEM(p, j) * xv;               \
            }                                                                                                   \
            p += PANEL;                                                                                         \
        }                                                                                                       \
        for (int m = 0; m < mt; m++)                                                                            \
            for (int j = 0; j < valid; j++) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.0f);               \
    }
#define load_row_f32 elem_f32
#define load_row_bf16 elem_bf16
#endif
#if !TG_AVX2
DEFINE_TILE(tile_f32, float, load_row_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_row_bf16)
#endif

#define TILE_HEIGHTS(TILE, PANEL_PTR)                                                                           \
    switch (M - m0 < MR ? M - m0 : MR) { /* constant tile heights keep the accumulators in registers */       \
    case 1: TILE(xm, ldx, 1, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                   \
    case 2: TILE(xm, ldx, 2, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                   \
    case 3: TILE(xm, ldx, 3, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                   \
    case 4: TILE(xm, ldx, 4, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                   \
    case 5: TILE(xm, ldx, 5, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                   \
    default: TILE(xm, ldx, MR, PANEL_PTR, K, b, ym, ldy, valid, pf_end); break;                                 \
    }

/* Panels [p_begin, p_end) of y = x . W^T (+ bias) for all M tokens, W packed by tg_pack (fmt TG_F32) or
 * tg_pack_bf16 (TG_BF16). */
static void gemm_panels(const float *x, int64_t M, int64_t K, int64_t ldx, const void *P, int fmt, int64_t N,
                        const float *bias, float *y, int64_t ldy, int64_t p_begin, int64_t p_end) {
    const char *pf_end = (const char *)P + p_end * K * PANEL * (fmt == TG_BF16 ? 2 : 4); /* this thread's panels */
#if TG_AVX2
    const int next = (p_end - p_begin) * K * PANEL * (fmt == TG_BF16 ? 2 : 4) >= TG_NEXT_MIN;
#endif
    for (int64_t p = p_begin; p < p_end; p++) {
        int64_t n = p * PANEL;
        int valid = (int)(N - n < PANEL ? N - n : PANEL);
        const float *b = bias ? bias + n : NULL;
#if TG_AVX2
        if (fmt == TG_BF16)
            tile_bf16(x, ldx, M, (const uint16_t *)P + p * K * PANEL, K, b, y + n, ldy, valid, pf_end, next);
        else tile_f32(x, ldx, M, (const float *)P + p * K * PANEL, K, b, y + n, ldy, valid, pf_end, next);
#else
#if TG_AVX512
        if (M > MR) {
            if (fmt == TG_BF16) tile_bf16_blocked(x, ldx, M, (const uint16_t *)P + p * K * PANEL, K, b, y + n, ldy, valid, pf_end);
            else tile_f32_blocked(x, ldx, M, (const float *)P + p * K * PANEL, K, b, y + n, ldy, valid, pf_end);
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + n;
            if (fmt == TG_BF16) {
                const uint16_t *panel = (const uint16_t *)P + p * K * PANEL;
                TILE_HEIGHTS(tile_bf16, panel)
            } else {
                const float *panel = (const float *)P + p * K * PANEL;
                TILE_HEIGHTS(tile_f32, panel)
            }
        }
#endif
    }
}

/* The panels a thread owns out of `count`: contiguous, balanced to within one. */
static void share(int64_t count, int tid, int nth, int64_t *begin, int64_t *end) {
    int64_t per = count / nth, extra = count % nth;
    *begin = tid * per + (tid < extra ? tid : extra);
    *end = *begin + per + (tid < extra ? 1 : 0);
}

static int clamp_threads(int nthreads, int64_t work) {
    /* A parallel region waits for its slowest thread: on a busy machine a thread that lost its core holds
     * the region for a scheduler time slice (measured here with another job on the second core: the demo
     * model's batch-1 decode fell from ~2,000 to ~200 tok/s with its one 1M multiply-add region split).
     * Split only work big enough (~2M multiply-adds: 8 MB of fp32 weights at batch 1, ~250 us on one
     * core) for the gain to outweigh that risk. */
    if (nthreads < 1 || work < (1 << 21)) return 1;
    return nthreads;
}

#ifdef _OPENMP
#define THREAD_ID() omp_get_thread_num()
#define THREADS() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREADS() 1
#endif

/* ---------------------------------------------------------------------------------------------------
 * Weight-only quantized products (Q8_0, Q4_0), the llama.cpp way: each activation row is quantized once
 * per call to int8 in 32-element blocks (fp32 scale amax / 127, round to nearest even), and every
 * (weight block, activation block) pair is an exact int8 dot product, scaled by the two blocks' scales and
 * accumulated in fp32, block after block.
 *
 * Layout (tg_pack_q, once at load): the rows in groups of QG = 16, and per group and 32-element block the
 * 16 rows' fp16 scales (32 bytes) followed by their quants interleaved four bytes at a time, so that one
 * 64-byte vector holds the same four elements of all 16 rows: Q8_0 eight such vectors of q + 128 (unsigned),
 * Q4_0 four vectors of ggml's nibble bytes (bytes 4c..4c+3 of each row: elements 4c..4c+3 in the low
 * nibbles, 16 + 4c.. in the high ones, q + 8 unsigned). The same bytes as ggml's blocks (rows past N, to a
 * whole group, are zero). A product then multiplies 16 rows at once with `vpdpbusd`: the unsigned weight
 * bytes of a vector by four activation bytes broadcast to every row, the integer sums starting from the
 * offsets' share, -128 sum(x) (Q8_0) or -8 sum(x) (Q4_0) of the block, so each row's block sum is exactly
 * sum_j q_j x_j; one int -> float conversion and one multiply-add (scales of 16 rows times the activation
 * block's) per block, 16 rows and token. llama.cpp's repacked Q4_0 (8 rows by 8 bytes) works the same way.
 * Work splits over 64-row panels (four groups) as for the panel formats; each panel is finished for MQ
 * tokens at a time, so its weights stay in cache while every token passes over them.
 */
#define MQ 4  /* tokens per quantized register tile */
#define QG 16 /* rows per interleaved group */

static inline int64_t block_bytes(int fmt) { return fmt == TG_Q8_0 ? 2 + QK : 2 + QK / 2; }
static inline int64_t groups_of(int64_t n) { return (n + QG - 1) / QG; }

/* Bytes of one packed [N, K] matrix in format `fmt` (one expert's stride in a stacked tensor). */
static int64_t weight_bytes(int fmt, int64_t N, int64_t K) {
    if (fmt == TG_Q8_0 || fmt == TG_Q4_0) return groups_of(N) * QG * (K / QK) * block_bytes(fmt);
    return panels_of(N) * PANEL * K * (fmt == TG_BF16 ? 2 : 4);
}

int64_t tg_packed_q_bytes(int fmt, int64_t N, int64_t K) { return weight_bytes(fmt, N, K); }

/* ggml row-major blocks src [N, K / 32 blocks] -> the interleaved layout above (dst: tg_packed_q_bytes). */
void tg_pack_q(const uint8_t *src, int fmt, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t nb = K / QK, bs = block_bytes(fmt), qbytes = bs - 2;
    for (int64_t g = 0; g < groups_of(N); g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * QG * bs, *qs = out + 2 * QG;
            for (int r = 0; r < QG; r++) {
                const int64_t n = g * QG + r;
                const uint8_t *blk = n < N ? src + (n * nb + b) * bs : NULL;
                if (blk)
                    memcpy(out + 2 * r, blk, 2);
                else
                    memset(out + 2 * r, 0, 2);
                for (int64_t j = 0; j < qbytes; j++) {
                    uint8_t v = blk ? blk[2 + j] : (fmt == TG_Q8_0 ? 0 : 0x88); /* q = 0 */
                    qs[(j / 4) * 4 * QG + r * 4 + j % 4] = fmt == TG_Q8_0 ? (uint8_t)(v ^ 0x80) : v;
                }
            }
        }
}

static inline float from_fp16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* Row m of x [M, K] (row stride ldx) -> xd [M, K/32] fp32 scales and xq [M, K] int8. */
static void quantize_row_q8(const float *x, int64_t K, float *xd, int8_t *xq) {
#if TG_AVX512
    /* the same operations 16 lanes at a time: vmaxps keeps the running maximum where |v| is NaN, as the
     * comparison below does; vcvtps2dq rounds to nearest even, as nearbyintf does in the default mode */
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        __m512 mx = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_setzero_ps());
        mx = _mm512_max_ps(_mm512_andnot_ps(sign, v1), mx);
        const float amax = _mm512_reduce_max_ps(mx), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        const __m512 idv = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(xq + b * QK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, idv))));
        _mm_storeu_si128((__m128i *)(xq + b * QK + 16),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, idv))));
    }
#elif TG_AVX2
    /* the same steps 8 lanes at a time (vmaxps and vcvtps2dq as above); the int32 -> int8 packs work within
     * 128-bit lanes, and one permutation puts the 32 bytes back in element order (as llama.cpp's AVX2 code) */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = _mm_cvtss_f32(m4), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * QK), _mm256_permutevar8x32_epi32(bytes, order));
    }
#else
    for (int64_t b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        for (int j = 0; j < QK; j++) xq[b * QK + j] = (int8_t)nearbyintf(v[j] * id);
    }
#endif
}

void tg_quantize_rows_q8(const float *x, int64_t M, int64_t K, int64_t ldx, float *xd, int8_t *xq) {
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, xd + m * (K / QK), xq + m * K);
}

/* The offsets' share of each activation block's integer sum (see the layout above): xs[m * nb + b] =
 * -128 sum(xq) (Q8_0) or -8 sum(xq) (Q4_0) of block b of token m. */
static void block_offsets(const int8_t *xq, int64_t M, int64_t K, int fmt, int32_t *xs) {
    const int64_t nb = K / QK;
    const int32_t off = fmt == TG_Q8_0 ? -128 : -8;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *v = xq + m * K + b * QK;
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += v[j];
            xs[m * nb + b] = off * s;
        }
}

/* Four activation bytes as one int32 (broadcast to every row by the vector kernels below). */
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TG_VNNI 1
typedef __m512 qtile_out[MQ]; /* per token, 16 lanes: the group's 16 rows */
/* One group's 16 rows by mt (<= MQ) tokens: out[m] (16 lanes, one per row). */
static inline __attribute__((always_inline)) void qgroup_tile(const uint8_t *w, int fmt, int64_t nb, const float *xd,
                                                              const int8_t *xq, const int32_t *xs, int64_t K,
                                                              const int mt, __m512 out[MQ], const char *pf_end) {
    __m512 acc[MQ];
    for (int m = 0; m < MQ; m++) acc[m] = _mm512_setzero_ps();
    const int64_t gbs = QG * block_bytes(fmt);
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int level = tg_pf_level;
    for (int64_t b = 0; b < nb; b++, w += gbs) {
        if (TG_PF && (const char *)w + TG_PF < pf_end)
            for (int64_t i = 0; i < gbs; i += 64) PF_LINE((const char *)w + TG_PF + i, level);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        __m512i v[8];
        if (fmt == TG_Q8_0) {
            for (int c = 0; c < 8; c++) v[c] = _mm512_loadu_si512((const void *)(w + 2 * QG + 64 * c));
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(w + 2 * QG + 64 * c));
                v[c] = _mm512_and_si512(raw, low);
                v[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        }
        for (int m = 0; m < MQ; m++)
            if (m < mt) {
                const int8_t *x = xq + m * K + b * QK;
                /* two chains of four: the dot products' latency overlaps */
                __m512i s0 = _mm512_set1_epi32(xs[m * nb + b]), s1 = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    s0 = _mm512_dpbusd_epi32(s0, v[c], _mm512_set1_epi32(load_i32(x + 4 * c)));
                    s1 = _mm512_dpbusd_epi32(s1, v[c + 4], _mm512_set1_epi32(load_i32(x + 16 + 4 * c)));
                }
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xd[m * nb + b])),
                                         _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[m]);
            }
    }
    for (int m = 0; m < MQ; m++) out[m] = acc[m];
}
#elif TG_AVX2
#define TG_Q_AVX2 1
typedef __m256 qtile_out[MQ][2]; /* per token, two 8-lane halves: rows 0-7 and 8-15 */
/* One group's 16 rows by mt (<= MQ) tokens with AVX2 (no VNNI): each 32-byte half of a 64-byte vector holds
 * the same four elements of 8 rows, so out[m][h] has rows 8h..8h+7. vpmaddubsw multiplies unsigned by signed
 * bytes and adds pairs into saturating int16: Q4_0's unsigned nibbles (<= 15) times int8 activations stay far
 * below the limit even summed over the block's eight products (8 * 2 * 15 * 127 = 30,480), so one vpmaddwd per
 * block widens them, plus the offsets' share as in the VNNI kernel. Q8_0's bytes (q + 128) would saturate, so
 * they are turned back into q and multiplied the way llama.cpp's AVX2 kernels do: |q| by x with q's sign
 * (at most 2 * 128 * 127 = 32,512 per pair), widened per vector; no offset. Integer sums are exact, and the
 * floating-point steps are the VNNI kernel's (scale product, conversion, one fused multiply-add per block). */
static inline __attribute__((always_inline)) void qgroup_tile(const uint8_t *w, int fmt, int64_t nb, const float *xd,
                                                              const int8_t *xq, const int32_t *xs, int64_t K,
                                                              const int mt, __m256 out[MQ][2], const char *pf_end) {
    __m256 acc[MQ][2];
    for (int m = 0; m < MQ; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const int64_t gbs = QG * block_bytes(fmt);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const int level = tg_pf_level;
    for (int64_t b = 0; b < nb; b++, w += gbs) {
        if (TG_PF && (const char *)w + TG_PF < pf_end)
            for (int64_t i = 0; i < gbs; i += 64) PF_LINE((const char *)w + TG_PF + i, level);
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16 * h)));
            const uint8_t *qs = w + 2 * QG + 32 * h;
            __m256i v[8];
            if (fmt == TG_Q8_0) {
                for (int c = 0; c < 8; c++) v[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 64 * c)), flip);
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * c));
                    v[c] = _mm256_and_si256(raw, low);
                    v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
            }
            for (int m = 0; m < MQ; m++)
                if (m < mt) {
                    const int8_t *x = xq + m * K + b * QK;
                    __m256i isum;
                    if (fmt == TG_Q8_0) {
                        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                        for (int c = 0; c < 8; c += 2) {
                            const __m256i x0 = _mm256_set1_epi32(load_i32(x + 4 * c));
                            const __m256i x1 = _mm256_set1_epi32(load_i32(x + 4 * c + 4));
                            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                _mm256_sign_epi8(v[c], v[c]), _mm256_sign_epi8(x0, v[c])), ones));
                            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                _mm256_sign_epi8(v[c + 1], v[c + 1]), _mm256_sign_epi8(x1, v[c + 1])), ones));
                        }
                        isum = _mm256_add_epi32(s0, s1);
                    } else {
                        __m256i s16 = _mm256_setzero_si256();
                        for (int c = 0; c < 4; c++) {
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[c], _mm256_set1_epi32(load_i32(x + 4 * c))));
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[c + 4],
                                                                             _mm256_set1_epi32(load_i32(x + 16 + 4 * c))));
                        }
                        isum = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(xs[m * nb + b]));
                    }
                    acc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[m * nb + b])),
                                                _mm256_cvtepi32_ps(isum), acc[m][h]);
                }
        }
    }
    for (int m = 0; m < MQ; m++) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}
#else
/* The same sums, one row and token at a time (any compiler target). */
static void qgroup_tile(const uint8_t *w, int fmt, int64_t nb, const float *xd, const int8_t *xq, const int32_t *xs,
                        int64_t K, const int mt, float out[MQ][QG]) {
    const int64_t gbs = QG * block_bytes(fmt);
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < QG; r++) out[m][r] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += gbs) {
        const uint8_t *qs = w + 2 * QG;
        for (int r = 0; r < QG; r++) {
            uint16_t h;
            memcpy(&h, w + 2 * r, 2);
            const float dw = from_fp16(h);
            uint8_t u[QK]; /* the row's unsigned quants, element order */
            for (int j = 0; j < QK; j++) {
                if (fmt == TG_Q8_0) {
                    u[j] = qs[(j / 4) * 4 * QG + r * 4 + j % 4];
                } else {
                    const int jj = j % 16;
                    const uint8_t byte = qs[(jj / 4) * 4 * QG + r * 4 + jj % 4];
                    u[j] = j < 16 ? byte & 0x0F : byte >> 4;
                }
            }
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + b * QK;
                int32_t isum = xs[m * nb + b];
                for (int j = 0; j < QK; j++) isum += (int32_t)u[j] * (int32_t)x[j];
                out[m][r] += dw * xd[m * nb + b] * (float)isum;
            }
        }
    }
}
#endif

/* Row groups of panels [p_begin, p_end) (64 rows each) of y = x . W^T (+ bias) for all M tokens, x given
 * quantized (xd, xq from tg_quantize_rows_q8), W packed by tg_pack_q in `fmt` (Q8_0 or Q4_0). Returns 0, or -1
 * if memory could not be allocated. */
static int qgemm_panels(const float *xd, const int8_t *xq, int64_t M, int64_t K, const uint8_t *W, int fmt,
                        int64_t N, const float *bias, float *y, int64_t ldy, int64_t p_begin, int64_t p_end) {
    const int64_t nb = K / QK, group_bytes = nb * QG * block_bytes(fmt);
    int32_t small[1024], *xs = M * nb <= 1024 ? small : malloc(sizeof(int32_t) * M * nb);
    if (!xs) return -1;
    block_offsets(xq, M, K, fmt, xs);
    const int64_t g_end = p_end * (PANEL / QG) < groups_of(N) ? p_end * (PANEL / QG) : groups_of(N);
    const char *pf_end = (const char *)W + g_end * group_bytes; /* this thread's rows */
    for (int64_t p = p_begin; p < p_end; p++)
        for (int64_t m0 = 0; m0 < M; m0 += MQ) {
            const int mt = (int)(M - m0 < MQ ? M - m0 : MQ);
            const float *xdm = xd + m0 * nb;
            const int8_t *xqm = xq + m0 * K;
            const int32_t *xsm = xs + m0 * nb;
            for (int64_t g = p * (PANEL / QG); g < (p + 1) * (PANEL / QG) && g < g_end; g++) {
                const uint8_t *w = W + g * group_bytes;
                const int64_t n = g * QG;
                const int valid = (int)(N - n < QG ? N - n : QG);
#if defined(TG_VNNI) || defined(TG_Q_AVX2)
                qtile_out out;
                switch (mt) { /* constant tile heights keep the accumulators in registers */
                case 1: qgroup_tile(w, fmt, nb, xdm, xqm, xsm, K, 1, out, pf_end); break;
                case 2: qgroup_tile(w, fmt, nb, xdm, xqm, xsm, K, 2, out, pf_end); break;
                case 3: qgroup_tile(w, fmt, nb, xdm, xqm, xsm, K, 3, out, pf_end); break;
                default: qgroup_tile(w, fmt, nb, xdm, xqm, xsm, K, MQ, out, pf_end); break;
                }
#endif
#if defined(TG_VNNI)
                const __mmask16 mask = valid >= QG ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1u);
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
                for (int m = 0; m < mt; m++)
                    _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n, mask, _mm512_add_ps(out[m], bv));
#elif defined(TG_Q_AVX2)
                for (int m = 0; m < mt; m++) {
                    float o[QG];
                    _mm256_storeu_ps(o, out[m][0]);
                    _mm256_storeu_ps(o + 8, out[m][1]);
                    for (int r = 0; r < valid; r++) y[(m0 + m) * ldy + n + r] = o[r] + (bias ? bias[n + r] : 0.0f);
                }
#else
                float out[MQ][QG];
                (void)pf_end;
                qgroup_tile(w, fmt, nb, xdm, xqm, xsm, K, mt, out);
                for (int m = 0; m < mt; m++)
                    for (int r = 0; r < valid; r++) y[(m0 + m) * ldy + n + r] = out[m][r] + (bias ? bias[n + r] : 0.0f);
#endif
            }
        }
    if (xs != small) free(xs);
    return 0;
}

static inline int is_quantized(int fmt) { return fmt == TG_Q8_0 || fmt == TG_Q4_0; }

/* One product over panels [p_begin, p_end) in any format: x as floats for the panel formats, quantized
 * (xd, xq) for the block formats. */
static int gemm_any(const float *x, const float *xd, const int8_t *xq, int64_t M, int64_t K, int64_t ldx,
                    const void *W, int fmt, int64_t N, const float *bias, float *y, int64_t ldy, int64_t p_begin,
                    int64_t p_end) {
    if (is_quantized(fmt)) return qgemm_panels(xd, xq, M, K, (const uint8_t *)W, fmt, N, bias, y, ldy, p_begin, p_end);
    gemm_panels(x, M, K, ldx, W, fmt, N, bias, y, ldy, p_begin, p_end);
    return 0;
}

/* y[M, N] = x . W^T (+ bias), W in format `fmt`. Returns 0, or -1 if memory could not be allocated. */
int tg_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const void *P, int fmt, int64_t N,
              const float *bias, float *y, int64_t ldy, int nthreads) {
    float *xd = NULL;
    int8_t *xq = NULL;
    if (is_quantized(fmt)) { /* the activation rows, quantized once for every row group */
        xd = malloc(sizeof(float) * (M * (K / QK) + 1));
        xq = malloc((size_t)(M * K + 1));
        if (!xd || !xq) {
            free(xd);
            free(xq);
            return -1;
        }
        tg_quantize_rows_q8(x, M, K, ldx, xd, xq);
    }
    int nth = clamp_threads(nthreads, M * N * K), failed = 0;
    if (nth == 1) {
        failed = gemm_any(x, xd, xq, M, K, ldx, P, fmt, N, bias, y, ldy, 0, panels_of(N));
    } else {
#pragma omp parallel num_threads(nth)
        {
            int64_t b, e;
            share(panels_of(N), THREAD_ID(), THREADS(), &b, &e);
            if (gemm_any(x, xd, xq, M, K, ldx, P, fmt, N, bias, y, ldy, b, e)) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    free(xd);
    free(xq);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Sparse MoE block for a few tokens.
 *
 * router [E, H] row-major; gate_up: E experts, each [2I, H] in format `fmt` (panels or blocks; gate rows
 * first), one after another; down: E experts, each [H, I] packed the same way; k_per_token [M] (each 1..k_max) or NULL (all
 * k_max). Routing matches engine.moe.route: softmax over all experts in fp32, top-k (ties to the lower
 * expert id), slots past a token's k weigh 0, optional renormalisation over the kept weights. Each
 * selected expert runs once over all its tokens. y [M, H] is overwritten. Returns 0, or -1 if memory
 * could not be allocated.
 *
 * Two steps, so that a decode step can run the block inside its own thread team (tg_step.c): `moe_route`
 * (one thread: router, top-k, each expert's tokens gathered) and `moe_experts` (every thread of a team).
 */
static inline float silu(float v) { return v / (1.0f + expf(-v)); }
static void silu_mul(float *g, int64_t I); /* the SwiGLU activation of one row (below, beside the vector exps) */

/* A MoE block's buffers, for up to M tokens of k_max experts among E, intermediate size I (one allocation). */
typedef struct {
    int64_t M, H, E, I;
    int k_max, quant, failed; /* failed: an expert product could not allocate its scratch */
    float *logits, *selw, *tokw, *rows, *act, *eout, *rows_d, *act_d;
    int32_t *sel;
    int64_t *count, *offset, *tok, assignments;
    int8_t *rows_q, *act_q;
    char *base;
} moe_work;

static size_t carve(char *base, size_t *at, size_t bytes, void **out) {
    *out = base ? base + *at : NULL;
    *at += (bytes + 63) & ~(size_t)63;
    return *at;
}

static int moe_alloc(moe_work *w, int64_t M, int64_t H, int64_t E, int64_t I, int k_max, int quant) {
    w->M = M, w->H = H, w->E = E, w->I = I, w->k_max = k_max, w->quant = quant, w->failed = 0, w->base = NULL;
    const int64_t A = M * k_max; /* at most this many (token, expert) assignments */
    for (int pass = 0; pass < 2; pass++) {
        size_t at = 0;
        carve(w->base, &at, sizeof(float) * M * E, (void **)&w->logits);
        carve(w->base, &at, sizeof(int32_t) * A, (void **)&w->sel);
        carve(w->base, &at, sizeof(float) * A, (void **)&w->selw);
        carve(w->base, &at, sizeof(int64_t) * E, (void **)&w->count);
        carve(w->base, &at, sizeof(int64_t) * (E + 1), (void **)&w->offset);
        carve(w->base, &at, sizeof(int64_t) * A, (void **)&w->tok);
        carve(w->base, &at, sizeof(float) * A, (void **)&w->tokw);
        carve(w->base, &at, sizeof(float) * A * H, (void **)&w->rows);
        carve(w->base, &at, sizeof(float) * A * 2 * I, (void **)&w->act);
        carve(w->base, &at, sizeof(float) * A * H, (void **)&w->eout);
        /* block formats: the expert inputs and the SwiGLU activations, quantized once each */
        carve(w->base, &at, quant ? sizeof(float) * A * (H / QK) : 0, (void **)&w->rows_d);
        carve(w->base, &at, quant ? (size_t)(A * H) : 0, (void **)&w->rows_q);
        carve(w->base, &at, quant ? sizeof(float) * A * (I / QK) : 0, (void **)&w->act_d);
        carve(w->base, &at, quant ? (size_t)(A * I) : 0, (void **)&w->act_q);
        if (pass == 0 && !(w->base = malloc(at ? at : 1))) return -1;
    }
    return 0;
}

/* Router logits, softmax, top-k and each selected expert's tokens gathered (w->rows, by expert) for x [M, H]
 * (M <= the allocated M; w->E and w->I may be lowered to a layer's, within the allocation). */
static void moe_route(moe_work *w, const float *x, int64_t M, const float *router, const int32_t *k_per_token,
                      int normalize) {
    const int64_t H = w->H, E = w->E;
    const int k_max = w->k_max;
    float *logits = w->logits, *selw = w->selw;
    int32_t *sel = w->sel;
    int64_t *count = w->count, *offset = w->offset;
    w->M = M;
    memset(count, 0, sizeof(int64_t) * E);
    for (int64_t m = 0; m < M; m++)
        for (int64_t e = 0; e < E; e++) {
            const float *a = x + m * H, *b = router + e * H;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t h = 0; h < H; h++) dot += a[h] * b[h];
            logits[m * E + e] = dot;
        }
    int64_t assignments = 0;
    for (int64_t m = 0; m < M; m++) {
        float *l = logits + m * E;
        float mx = -FLT_MAX, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int64_t e = 0; e < E; e++) {
            l[e] = expf(l[e] - mx);
            sum += l[e];
        }
        for (int64_t e = 0; e < E; e++) l[e] /= sum;
        int k = k_per_token ? k_per_token[m] : k_max;
        float kept = 0.0f;
        for (int s = 0; s < k_max; s++) { /* top-k_max by repeated argmax; slots past k weigh 0 */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < s; j++) taken |= sel[m * k_max + j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            sel[m * k_max + s] = (int32_t)best;
            selw[m * k_max + s] = s < k ? l[best] : 0.0f;
            kept += selw[m * k_max + s];
        }
        for (int s = 0; s < k; s++) {
            if (normalize) selw[m * k_max + s] /= kept;
            count[sel[m * k_max + s]]++;
            assignments++;
        }
    }
    offset[0] = 0;
    for (int64_t e = 0; e < E; e++) offset[e + 1] = offset[e] + count[e];
    memset(count, 0, sizeof(int64_t) * E); /* reused as fill cursors */
    for (int64_t m = 0; m < M; m++) {
        int k = k_per_token ? k_per_token[m] : k_max;
        for (int s = 0; s < k; s++) {
            int64_t e = sel[m * k_max + s], at = offset[e] + count[e]++;
            w->tok[at] = m;
            w->tokw[at] = selw[m * k_max + s];
            memcpy(w->rows + at * H, x + m * H, sizeof(float) * H);
        }
    }
    w->assignments = assignments;
}

/* The routed experts' SwiGLU products into y [M, H] (overwritten), run by thread `tid` of a team of `nth`
 * (the calling parallel region's, or one thread outside any): each thread its share of every selected
 * expert's output panels, then of y's columns (summed in a fixed expert order per element, so the result
 * does not depend on the team size). Ends without a barrier. */
static void moe_experts(moe_work *w, const void *gate_up, const void *down, int fmt, float *y, int tid, int nth) {
    const int64_t M = w->M, H = w->H, E = w->E, I = w->I, assignments = w->assignments;
    const int64_t gu_size = weight_bytes(fmt, 2 * I, H), down_size = weight_bytes(fmt, H, I);
    const int64_t *offset = w->offset;
    const int quant = w->quant;
    float *act = w->act;
    int64_t b, e_;
    if (quant) {
#pragma omp for schedule(static)
        for (int64_t a = 0; a < assignments; a++)
            quantize_row_q8(w->rows + a * H, H, w->rows_d + a * (H / QK), w->rows_q + a * H);
    }
    share(panels_of(2 * I), tid, nth, &b, &e_); /* gate/up: each thread its share of every expert's panels */
    for (int64_t e = 0; e < E; e++)
        if (offset[e + 1] > offset[e])
            if (gemm_any(w->rows + offset[e] * H, quant ? w->rows_d + offset[e] * (H / QK) : NULL,
                         quant ? w->rows_q + offset[e] * H : NULL, offset[e + 1] - offset[e], H, H,
                         (const char *)gate_up + e * gu_size, fmt, 2 * I, NULL, act + offset[e] * 2 * I, 2 * I, b,
                         e_)) {
#pragma omp atomic write
                w->failed = 1;
            }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t a = 0; a < assignments; a++) { /* act[:, :I] = silu(gate) * up */
        float *g = act + a * 2 * I;
        silu_mul(g, I);
        if (quant) quantize_row_q8(g, I, w->act_d + a * (I / QK), w->act_q + a * I);
    }
    share(panels_of(H), tid, nth, &b, &e_); /* down */
    for (int64_t e = 0; e < E; e++)
        if (offset[e + 1] > offset[e])
            if (gemm_any(act + offset[e] * 2 * I, quant ? w->act_d + offset[e] * (I / QK) : NULL,
                         quant ? w->act_q + offset[e] * I : NULL, offset[e + 1] - offset[e], I, 2 * I,
                         (const char *)down + e * down_size, fmt, H, NULL, w->eout + offset[e] * H, H, b, e_)) {
#pragma omp atomic write
                w->failed = 1;
            }
#pragma omp barrier
    share(H, tid, nth, &b, &e_); /* y[t] = sum of w * eout[a], in a fixed (expert) order per element */
    for (int64_t m = 0; m < M; m++) memset(y + m * H + b, 0, sizeof(float) * (e_ - b));
    for (int64_t a = 0; a < assignments; a++) {
        float wt = w->tokw[a];
        float *dst = y + w->tok[a] * H;
        const float *src = w->eout + a * H;
        for (int64_t h = b; h < e_; h++) dst[h] += wt * src[h];
    }
}

int tg_moe(const float *x, int64_t M, int64_t H, const float *router, int64_t E, const void *gate_up,
           const void *down, int fmt, int64_t I, int k_max, const int32_t *k_per_token, int normalize, float *y,
           int nthreads) {
    if (M <= 0) return 0;
    moe_work w;
    if (moe_alloc(&w, M, H, E, I, k_max, is_quantized(fmt))) return -1;
    moe_route(&w, x, M, router, k_per_token, normalize);
    int64_t assignments = w.assignments;
    int nth = clamp_threads(nthreads, assignments * 3 * H * I);
#pragma omp parallel num_threads(nth)
    moe_experts(&w, gate_up, down, fmt, y, THREAD_ID(), THREADS());
    free(w.base);
    return w.failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Paged decode attention: one new query per sequence.
 *
 * q [B, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, width] (int64);
 * context_lens [B] (keys 0..L-1 are valid, the last one written this step); window 0 = unlimited, else
 * keys [L - window, L). out [B, Hq, D]. Returns 0, or -1 if memory could not be allocated.
 *
 * Per (sequence, KV head) pair the cache is walked block by block (no division per key): each K row is read
 * once for all the query heads sharing it, the softmax's exponentials are taken 16 at a time, and the V rows
 * are summed with the weights in registers. A speculative verify runs one such query per draft token, so
 * this cost is paid per verified row.
 */
#if TG_AVX512
/* exp(x) on 16 lanes (softmax arguments, x <= 0; and silu's, see silu_mul): x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by Cephes' degree-6 polynomial, times 2^n by vscalefps (which flushes to 0 far below the normal range).
 * Within 2 ulp of expf; the scalar loop the portable build keeps calls expf. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#if TG_AVX2
/* exp(x) on 8 lanes: exp16's reduction and polynomial, times 2^n built in the exponent bits; x is clamped to
 * [-87, 88] so 2^n stays normal (for softmax, exp(-87) ~ 1.6e-38 is nothing beside the maximum's 1; for silu,
 * v / (1 + exp(88)) for v <= -88 is within 1e-36 of its true value, as expf's infinity is). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* g[0:I] = silu(g[0:I]) * g[I:2I], the SwiGLU activation of one row: 16 (AVX-512) or 8 (AVX2) lanes at a time with
 * exp16 / exp8 (within 2 ulp of expf) and an IEEE division, the tail with expf. A 16-stream decode step of the
 * bench MoE takes 327,680 of them: ~0.95 ms with expf on a Zen 5 core (2.9 ns each), ~4% of the step. */
#if TG_AVX512 /* one vector of fp32 lanes, for the loops written once for both widths */
typedef __m512 vf;
#define VF_LANES 16
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_xor _mm512_xor_ps
#define vf_add _mm512_add_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_zero _mm512_setzero_ps
#define vf_exp exp16
#elif TG_AVX2
typedef __m256 vf;
#define VF_LANES 8
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_xor _mm256_xor_ps
#define vf_add _mm256_add_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_zero _mm256_setzero_ps
#define vf_exp exp8
#endif
static void silu_mul(float *g, int64_t I) {
    int64_t i = 0;
#if TG_AVX512 || TG_AVX2
    const vf one = vf_set1(1.0f), sign = vf_set1(-0.0f);
    for (; i + VF_LANES <= I; i += VF_LANES) {
        const vf v = vf_load(g + i);
        vf_store(g + i, vf_mul(vf_div(v, vf_add(one, vf_exp(vf_xor(v, sign)))), vf_load(g + I + i)));
    }
#endif
    for (; i < I; i++) g[i] = silu(g[i]) * g[I + i];
}

/* s[0:n] = exp(s[0:n] - mx); returns their sum (in a fixed order for a given n). */
static float exp_shifted(float *s, int64_t n, float mx) {
#if TG_AVX512
    __m512 m = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
        _mm512_mask_storeu_ps(s + t, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(acc);
#else
    float sum = 0.0f;
    int64_t t = 0;
#if TG_AVX2
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    return sum;
#endif
}

/* o_g[0:D] = sum_t w_g[t] v_t[0:D] for the gn (<= WG) query heads g of one KV head (o_g = o + g * D, w_g = w + g *
 * ldw) over n keys whose rows are `stride` floats apart (one block's: the caller passes one block at a time);
 * each o_g accumulates across calls. Each V row is loaded once for all gn heads (it was once per head: on a Zen 5
 * core the bench MoE's attention over 16 sequences of 512 tokens, 8 layers, cache hot, 6.44 -> 6.16 ms). Per
 * head the same sums in the same order as one head alone: two chains (even and odd keys) hide the FMA latency. */
#define WG 4
static inline __attribute__((always_inline)) void weighted_rows_n(float *o, const float *w, int64_t ldw, const int gn,
                                                                  const float *v, int64_t stride, int64_t n,
                                                                  int64_t D) {
#if TG_AVX512 || TG_AVX2
    if (D % VF_LANES == 0) {
        for (int64_t c = 0; c < D; c += VF_LANES) {
            vf a0[WG], a1[WG];
            for (int g = 0; g < gn; g++) {
                a0[g] = vf_load(o + g * D + c);
                a1[g] = vf_zero();
            }
            int64_t t = 0;
            for (; t + 1 < n; t += 2) {
                const vf v0 = vf_load(v + t * stride + c), v1 = vf_load(v + (t + 1) * stride + c);
                for (int g = 0; g < gn; g++) {
                    a0[g] = vf_fmadd(vf_set1(w[g * ldw + t]), v0, a0[g]);
                    a1[g] = vf_fmadd(vf_set1(w[g * ldw + t + 1]), v1, a1[g]);
                }
            }
            if (t < n) {
                const vf v0 = vf_load(v + t * stride + c);
                for (int g = 0; g < gn; g++) a0[g] = vf_fmadd(vf_set1(w[g * ldw + t]), v0, a0[g]);
            }
            for (int g = 0; g < gn; g++) vf_store(o + g * D + c, vf_add(a0[g], a1[g]));
        }
        return;
    }
#endif
    for (int g = 0; g < gn; g++)
        for (int64_t t = 0; t < n; t++) {
            const float *vv = v + t * stride;
            float wt = w[g * ldw + t], *og = o + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) og[d] += wt * vv[d];
        }
}

static void weighted_rows(float *o, const float *w, int64_t ldw, int64_t group, const float *v, int64_t stride,
                          int64_t n, int64_t D) {
    for (int64_t g = 0; g < group; g += WG) { /* constant head counts keep the accumulators in registers */
        float *og = o + g * D;
        const float *wg = w + g * ldw;
        switch (group - g < WG ? group - g : WG) {
        case 1: weighted_rows_n(og, wg, ldw, 1, v, stride, n, D); break;
        case 2: weighted_rows_n(og, wg, ldw, 2, v, stride, n, D); break;
        case 3: weighted_rows_n(og, wg, ldw, 3, v, stride, n, D); break;
        default: weighted_rows_n(og, wg, ldw, WG, v, stride, n, D); break;
        }
    }
}

/* q . k over D elements (16 lanes at a time where D allows). */
static inline float dot_row(const float *q, const float *k, int64_t D) {
#if TG_AVX512
    if (D % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif TG_AVX2
    if (D % 8 == 0) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
#endif
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; d++) dot += q[d] * k[d];
    return dot;
}

/* scale * (q_g . k) into s[g * lds] for the group's query heads g (q_g = q + g * D) against one key's row k. With
 * AVX-512 and a D of 64 or 128 the row's chunks are loaded once for every head and the loop over them unrolled
 * (on a Zen 5 core the bench MoE's attention over 16 sequences of 512 tokens, 8 layers, cache hot: 6.16 -> 5.53
 * ms); otherwise dot_row per head. The same sums in the same order as dot_row. */
#if TG_AVX512
static inline __attribute__((always_inline)) void score_key_chunks(const float *q, const float *k, const int nc,
                                                                   int64_t group, float *s, int64_t lds, float scale) {
    __m512 kc[8];
    for (int c = 0; c < nc; c++) kc[c] = _mm512_loadu_ps(k + 16 * c);
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * 16 * nc;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[0]);
        for (int c = 1; c < nc; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kc[c], acc);
        s[g * lds] = _mm512_reduce_add_ps(acc) * scale;
    }
}
#endif
static inline void score_key(const float *q, const float *k, int64_t D, int64_t group, float *s, int64_t lds,
                             float scale) {
#if TG_AVX512
    if (D == 64) {
        score_key_chunks(q, k, 4, group, s, lds, scale);
        return;
    }
    if (D == 128) {
        score_key_chunks(q, k, 8, group, s, lds, scale);
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) s[g * lds] = dot_row(q + g * D, k, D) * scale;
}

/* Prefetching a paged decode's keys. A decode step streams the weights between one layer's attention and the
 * next, so every K and V row comes from DRAM, one head's D floats every Hkv * D floats (one slot per token),
 * 16-token blocks scattered: a walk the hardware prefetchers do not run ahead of. On a Zen 5 core (2026-12-04)
 * the bench MoE's attention over 16 sequences of up to 48 tokens took 1.1-1.5 ms a step from memory against
 * 0.35 ms from cache, and 14 ms at 512 tokens. So each pair asks for its rows into L2 ahead of use: the first
 * PAIR_PF_KEYS keys of the pair two turns ahead of the one a thread computes (`paged_pair_prefetch`), and,
 * while scoring, the key PAIR_PF_KEYS ahead of the one scored. 8 layers, 16 sequences, one thread, cache
 * cold (a 256 MiB read in between): up to 48 tokens 1.49 -> 0.93 ms, 128 tokens 3.8 -> 2.2 ms, 512 tokens
 * 14.2 -> 6.9 ms. Only prefetches: the results are the same bits. */
#define PAIR_PF_KEYS 32
#define PAIRS_AHEAD 2
/* Where key t's row of KV head h starts in a paged cache (floats from its base), through the sequence's table. */
static inline int64_t key_row(const int64_t *table, int64_t t, int64_t block_size, int64_t Hkv, int64_t h, int64_t D) {
    return ((table[t / block_size] * block_size + t % block_size) * Hkv + h) * D;
}
static inline void prefetch_key_rows(const float *k_row, const float *v_row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) { /* 64-byte lines, into L2 */
        __builtin_prefetch(k_row + d, 0, 2);
        __builtin_prefetch(v_row + d, 0, 2);
    }
}

/* The K and V rows of the first PAIR_PF_KEYS keys pair p of a paged decode reads. */
static void paged_pair_prefetch(const float *k_cache, const float *v_cache, const int64_t *block_tables, int64_t width,
                                const int64_t *context_lens, int64_t Hkv, int64_t D, int64_t block_size, int64_t window,
                                int64_t p) {
    const int64_t row = Hkv * D, b = p / Hkv, h = p % Hkv, L = context_lens[b];
    const int64_t first = window > 0 && L > window ? L - window : 0;
    const int64_t last = L - first > PAIR_PF_KEYS ? first + PAIR_PF_KEYS : L;
    const int64_t *table = block_tables + b * width;
    for (int64_t t = first; t < last;) { /* block by block */
        int64_t len = block_size - t % block_size < last - t ? block_size - t % block_size : last - t;
        const int64_t at = key_row(table, t, block_size, Hkv, h, D);
        for (int64_t i = 0; i < len; i++) prefetch_key_rows(k_cache + at + i * row, v_cache + at + i * row, D);
        t += len;
    }
}

/* One (sequence b, KV head h) pair of a paged decode: the scores of its `group` query heads over the keys, walked
 * block by block (each K/V row read once for all of them), softmax, then the weighted V rows. `scores` holds
 * group * max_len floats. Its keys past the first PAIR_PF_KEYS are prefetched as it scores (see above). */
static void paged_pair(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                       int64_t width, const int64_t *context_lens, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t block_size, float scale, int64_t window, float *out, int64_t max_len, float *scores,
                       int64_t p) {
    const int64_t group = Hq / Hkv, row = Hkv * D; /* floats between consecutive slots of one head */
    int64_t b = p / Hkv, h = p % Hkv;
    int64_t L = context_lens[b];
    int64_t first = window > 0 && L > window ? L - window : 0, n = L - first;
    const int64_t *table = block_tables + b * width;
    const float *qh = q + (b * Hq + h * group) * D;
    int64_t ahead = first + PAIR_PF_KEYS, ahead_off = ahead % block_size; /* the key prefetched next, its slot */
    int64_t ahead_at = ahead < L ? key_row(table, ahead, block_size, Hkv, h, D) : 0; /* and where its row starts */
    for (int64_t t = first; t < L;) {
        int64_t off = t % block_size, len = block_size - off < L - t ? block_size - off : L - t;
        const float *kv = k_cache + key_row(table, t, block_size, Hkv, h, D);
        for (int64_t i = 0; i < len; i++, kv += row) {
            if (ahead < L) {
                prefetch_key_rows(k_cache + ahead_at, v_cache + ahead_at, D);
                if (++ahead < L) { /* the next slot of the block, or the next block's first (no division a key) */
                    ahead_off = ahead_off + 1 == block_size ? 0 : ahead_off + 1;
                    ahead_at = ahead_off ? ahead_at + row : key_row(table, ahead, block_size, Hkv, h, D);
                }
            }
            score_key(qh, kv, D, group, scores + t - first + i, max_len, scale);
        }
        t += len;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * max_len;
        float mx = -FLT_MAX;
        for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        float sum = exp_shifted(s, n, mx);
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t t = 0; t < n; t++) s[t] *= inv;
    }
    float *o = out + (b * Hq + h * group) * D; /* the group's heads, one after another */
    memset(o, 0, sizeof(float) * group * D);
    for (int64_t t = first; t < L;) {
        int64_t off = t % block_size, len = block_size - off < L - t ? block_size - off : L - t;
        const float *vv = v_cache + key_row(table, t, block_size, Hkv, h, D);
        weighted_rows(o, scores + t - first, max_len, group, vv, row, len, D);
        t += len;
    }
}

static int64_t max_context(const int64_t *context_lens, int64_t B) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    return max_len;
}

/* Pairs tid, tid + nth, ... of a paged decode, by thread `tid` of a team of `nth` (one already running, or
 * tg_paged_decode's): dealt out one at a time in turn, since a prefill run here (one query per new token) has
 * contexts growing 1, 2, ... n, which contiguous shares would leave to the last thread. 0 or -1 (memory). */
static int paged_decode_share(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                              int64_t width, const int64_t *context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                              int64_t D, int64_t block_size, float scale, int64_t window, float *out, int tid,
                              int nth) {
    const int64_t max_len = max_context(context_lens, B), pairs = B * Hkv;
    if (tid >= pairs) return 0;
    float *scores = malloc(sizeof(float) * (max_len > 0 ? max_len : 1) * (Hq / Hkv));
    if (!scores) return -1;
    for (int64_t a = 0; a < PAIRS_AHEAD && tid + a * nth < pairs; a++)
        paged_pair_prefetch(k_cache, v_cache, block_tables, width, context_lens, Hkv, D, block_size, window,
                            tid + a * nth);
    for (int64_t p = tid; p < pairs; p += nth) {
        if (p + PAIRS_AHEAD * nth < pairs)
            paged_pair_prefetch(k_cache, v_cache, block_tables, width, context_lens, Hkv, D, block_size, window,
                                p + PAIRS_AHEAD * nth);
        paged_pair(q, k_cache, v_cache, block_tables, width, context_lens, Hq, Hkv, D, block_size, scale, window, out,
                   max_len, scores, p);
    }
    free(scores);
    return 0;
}

int tg_paged_decode(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                    int64_t width, const int64_t *context_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t block_size, float scale, int64_t window, float *out, int nthreads) {
    const int64_t pairs = B * Hkv;
    int nth = clamp_threads(nthreads, pairs * max_context(context_lens, B) * D * (Hq / Hkv) * 2);
    if (nth > pairs) nth = (int)pairs;
    int failed = 0;
#pragma omp parallel num_threads(nth)
    if (paged_decode_share(q, k_cache, v_cache, block_tables, width, context_lens, B, Hq, Hkv, D, block_size, scale,
                           window, out, THREAD_ID(), THREADS())) {
#pragma omp atomic write
        failed = 1;
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------------
 * The small per-layer steps around the products, fused so a decode step makes few calls.
 */

/* h [M, H] += delta (if given), then x = rmsnorm(h) * weight (fp32, as F.rms_norm). */
void tg_add_rmsnorm(float *h, const float *delta, const float *weight, int64_t M, int64_t H, float eps, float *x) {
    for (int64_t m = 0; m < M; m++) {
        float *row = h + m * H, *out = x + m * H;
        float ss = 0.0f;
        if (delta) {
            const float *d = delta + m * H;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) {
                row[i] += d[i];
                ss += row[i] * row[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) ss += row[i] * row[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[i] = row[i] * inv * weight[i];
    }
}

/* qkv [T, (Hq + 2 Hkv) D] (q heads, then k heads, then v heads) for T new tokens: rotate q and k with
 * cos/sin [T, D] (Hugging Face rotate-half convention), write q to q_out [T, Hq, D] and the rotated k and
 * the v of token t to cache slot slots[t] of k_cache / v_cache [slots, Hkv, D]. */
void tg_rope_write_kv(const float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos,
                      const float *sin, float *q_out, float *k_cache, float *v_cache, const int64_t *slots) {
    int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
        for (int64_t head = 0; head < Hq + Hkv; head++) {
            const float *src = row + head * D;
            float *dst = head < Hq ? q_out + (t * Hq + head) * D : k_cache + (slots[t] * Hkv + head - Hq) * D;
            for (int64_t i = 0; i < half; i++) {
                dst[i] = src[i] * c[i] - src[i + half] * s[i];
                dst[i + half] = src[i + half] * c[i + half] + src[i] * s[i + half];
            }
        }
        memcpy(v_cache + slots[t] * Hkv * D, row + (Hq + Hkv) * D, sizeof(float) * Hkv * D);
    }
}

/* Sum of n floats with `nthreads` threads: a streaming read at the machine's best rate, the baseline
 * `tiergate bench engine` divides achieved weight-read bandwidth by. */
double tg_stream_sum(const float *buf, int64_t n, int nthreads) {
    double total = 0.0;
    int nth = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel num_threads(nth) reduction(+ : total)
    {
        int64_t b, e;
        share(n / 64, THREAD_ID(), THREADS(), &b, &e);
#if TG_AVX512
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = b * 64; i < e * 64; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(buf + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(buf + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(buf + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(buf + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = b * 64; i < e * 64; i++) s += buf[i];
        total += s;
#endif
    }
    for (int64_t i = n / 64 * 64; i < n; i++) total += buf[i];
    return total;
}

#include "tg_step.c" /* the whole decode step: tg_decode_layers, tg_decode_step */

/* Batch-invariant causal attention over the paged KV cache, for the CPU (rzero/ops/cpu_kernel.py).

   One work item is one (query token, KV head): it reads the token's query rows, and the keys and
   values of positions 0..pos of its sequence straight from the cache blocks, and writes the
   output rows. Nothing in it depends on the batch: not the other tokens, not how many there
   are, not padding, not whether the token came in a prefill, a decode step or a chunk, not the
   thread that runs it. Every reduction has one fixed order, written out below:

   - score = a length-D dot product in 16 lanes (lane l sums the d = l mod 16 terms in order of
     d, with fused multiply-adds), the lanes then added in a fixed tree (l + 8, + 4, + 2, + 1);
   - softmax: exact max (in any order: see max_of), exp by our own polynomial (the same bits
     whatever the vector width the compiler picks), and a sequential sum over keys in position
     order;
   - output = sum over keys in position order of e_j * v_j (fused multiply-adds from zero),
     divided by the softmax sum at the end.

   The layout of the work is free as long as each of these sums keeps its order: rows are read in
   place (bf16 widened on the fly), the G query heads of a KV head share each key load, and the
   weighted sums of two heads stay in registers (weighted_sum_pair).

   fmaf is exact by definition (one rounding), so the bits do not depend on whether the machine
   has FMA instructions, only the speed does. Compiled with -ffp-contract=off so that the
   compiler never fuses a multiply and an add on its own. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* Rows are held in buffers of Dp = D rounded up to LANES, zero past D: the padding adds exact
   zeros (fmaf(0, 0, acc) == acc), so every dot product runs whole lane groups. */
static inline void load_row(const void *base, int bf16, int64_t offset, int64_t D, float *restrict dst) {
    if (bf16) {
        /* bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word. */
        const uint16_t *restrict src = (const uint16_t *)base + offset;
        uint32_t *restrict bits = (uint32_t *)dst;
        for (int64_t d = 0; d < D; d++) bits[d] = (uint32_t)src[d] << 16;
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)D * sizeof(float));
    }
}

/* offsets[j] = cache offset of key position j < n of a sequence (block table `table`), KV head h. */
static inline void key_offsets(const int64_t *table, int64_t n, int64_t block, int64_t Hkv, int64_t h, int64_t D,
                               int64_t *restrict offsets) {
    for (int64_t j0 = 0; j0 < n; j0 += block) {
        const int64_t first = table[j0 / block] * block, end = j0 + block < n ? j0 + block : n;
        for (int64_t j = j0; j < end; j++) offsets[j] = ((first + j - j0) * Hkv + h) * D;
    }
}

/* Software prefetch of the cache row a few positions ahead (prefetch_ahead). One KV head's rows of
   consecutive positions lie Hkv rows apart, in blocks anywhere in the cache: the hardware
   prefetcher does not follow that, and at a 0.6B model's decode the loads stalled on memory half
   the time (docs/benchmarks.md, seventh session). No arithmetic: the bits cannot change. */
#define PREFETCH_AHEAD 8
/* The distance the loops use: rows of one cache line or less (bf16 at head_dim 32) twice as far,
   so that it runs about a kilobyte ahead either way (a tiny bf16 model's whole generate 1.05-1.06x;
   fp32 at head_dim 32, 128-byte rows, read 0.97-0.98x with 16; docs/benchmarks.md, sixteenth session). */
static inline int64_t prefetch_ahead(int bf16, int64_t D) { return D * (bf16 ? 2 : 4) <= 64 ? 16 : PREFETCH_AHEAD; }
static inline void prefetch_row(const void *base, int bf16, int64_t offset, int64_t D) {
    const char *p = (const char *)base + offset * (bf16 ? 2 : 4);
    const int64_t bytes = D * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* The fixed tree that adds a dot product's 16 lane sums: l += l + 8, += l + 4, += l + 2, then 0 + 1. */
static inline float lane_tree(float acc[LANES]) {
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

/* bf16 -> fp32 of one element: exact (the 16 bits become the high half of the fp32 word). */
static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch's conversion does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to bf16 and back: the value a bf16 tensor holds after an op computed in fp32. */
static inline float rounded_bf16(float f) { return bf16_value(float_to_bf16(f)); }

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
/* lane_tree with lanes 0-7 in lo and 8-15 in hi. */
static inline float lane_tree_avx(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);                                                  /* l += l + 8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));   /* l += l + 4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                  /* l += l + 2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                    /* 0 + 1 */
}

/* The same 16 lanes and tree as the portable version below, in two 8-wide registers. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t Dp) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t d = 0; d < Dp; d += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
    }
    return lane_tree_avx(lo, hi);
}
#else
static inline float dot(const float *restrict a, const float *restrict b, int64_t Dp) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < Dp; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[d + l], b[d + l], acc[l]);
    return lane_tree(acc);
}
#endif

static inline void axpy(float *restrict acc, float e, const float *restrict x, int64_t Dp) {
    for (int64_t d = 0; d < Dp; d++) acc[d] = fmaf(e, x[d], acc[d]);
}

#if defined(__AVX2__) && defined(__FMA__)
/* dot() with b a bf16 row widened on the fly: the same lanes, order and tree, so the same bits. */
static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t Dp) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t d = 0; d < Dp; d += LANES) {
        const __m256i wide_lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + d))), 16);
        const __m256i wide_hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + d + 8))), 16);
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_castsi256_ps(wide_lo), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_castsi256_ps(wide_hi), hi);
    }
    return lane_tree_avx(lo, hi);
}
#else
static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t Dp) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < Dp; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[d + l], bf16_value(b[d + l]), acc[l]);
    return lane_tree(acc);
}
#endif

static inline void axpy_bf16(float *restrict acc, float e, const uint16_t *restrict x, int64_t Dp) {
    for (int64_t d = 0; d < Dp; d++) acc[d] = fmaf(e, bf16_value(x[d]), acc[d]);
}

/* A K or V cache row as the kernels read it: in place (fp32, or bf16 widened on the fly) when D is
   a whole number of lane groups, else converted and zero-padded to Dp fp32 values in a buffer. */
typedef struct {
    const float *f32;
    const uint16_t *b16;
} Row;

static inline Row cache_row(const void *cache, int bf16, int64_t offset, int64_t D, int64_t Dp, float *buf) {
    if (D == Dp) return bf16 ? (Row){NULL, (const uint16_t *)cache + offset} : (Row){(const float *)cache + offset, NULL};
    load_row(cache, bf16, offset, D, buf);
    return (Row){buf, NULL};
}

static inline float dot_row(const float *restrict a, Row row, int64_t Dp) {
    return row.b16 ? dot_bf16(a, row.b16, Dp) : dot(a, row.f32, Dp);
}

static inline void axpy_row(float *restrict acc, float e, Row row, int64_t Dp) {
    if (row.b16)
        axpy_bf16(acc, e, row.b16, Dp);
    else
        axpy(acc, e, row.f32, Dp);
}

/* exp(x) for x <= 0 (scores minus their max): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
   then a degree-7 Taylor polynomial (error below one ulp); 0 below -87 (the fp32 normal limit). */
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float clamped = x < -87.0f ? -87.0f : x;
    float n = fmaf(clamped, 1.44269504088896341f, magic) - magic;
    float r = fmaf(n, -0.693145751953125f, clamped); /* ln2 in two parts: the first exact in fp32 */
    r = fmaf(n, -1.42860682030941723212e-6f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* The largest of s[0..n-1], softmax's shift, in 16 lanes. Its order is free: max is exact, and
   the one choice order could change, +0 or -0 when both are the largest, shifts every score by
   the same nothing (x - 0 == x - -0, and exp(+-0) == 1). */
static inline float max_of(const float *restrict s, int64_t n) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = s[0];
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = s[j + l] > lanes[l] ? s[j + l] : lanes[l];
    float top = s[0];
    for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

#if defined(__AVX512F__)
/* out_a, out_b = sum over j < n in position order of e_a[j] * V_j and e_b[j] * V_j (fused
   multiply-adds from zero): axpy_row's arithmetic, element for element, for two query heads at
   once, with the sums held in registers (`chunks` = Dp / 16, a constant after inlining). If
   total_a is not NULL, also *total_a, *total_b = the sums of e_a and e_b in position order from
   zero (the softmax sums: chains of additions that run free beside the multiply-adds' chains). */
static inline __attribute__((always_inline)) void weighted_sum_pair(
    int chunks, const float *restrict e_a, const float *restrict e_b, const void *v_cache, int bf16,
    const int64_t *restrict offsets, int64_t n, float *out_a, float *out_b, float *total_a, float *total_b) {
    /* out_a == out_b (and total_a == total_b) for an odd last head */
    __m512 a[8], b[8];
    float sum_a = 0.0f, sum_b = 0.0f;
    const int64_t ahead = prefetch_ahead(bf16, 16 * chunks);
    for (int c = 0; c < chunks; c++) a[c] = b[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (total_a) {
            sum_a += e_a[j];
            sum_b += e_b[j];
        }
        if (j + ahead < n) prefetch_row(v_cache, bf16, offsets[j + ahead], 16 * chunks);
        const __m512 wa = _mm512_set1_ps(e_a[j]), wb = _mm512_set1_ps(e_b[j]);
        for (int c = 0; c < chunks; c++) {
            const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        (const __m256i *)((const uint16_t *)v_cache + offsets[j] + 16 * c))), 16))
                                  : _mm512_loadu_ps((const float *)v_cache + offsets[j] + 16 * c);
            a[c] = _mm512_fmadd_ps(wa, v, a[c]);
            b[c] = _mm512_fmadd_ps(wb, v, b[c]);
        }
    }
    for (int c = 0; c < chunks; c++) {
        _mm512_storeu_ps(out_a + 16 * c, a[c]);
        _mm512_storeu_ps(out_b + 16 * c, b[c]);
    }
    if (total_a) {
        *total_a = sum_a;
        *total_b = sum_b;
    }
}

/* weighted_sum_pair for head dims of 32, 64 and 128 read in place; 0 if it does not apply. */
static int weighted_sum_registers(int64_t D, const float *e_a, const float *e_b, const void *v_cache, int bf16,
                                  const int64_t *offsets, int64_t n, float *out_a, float *out_b, float *total_a,
                                  float *total_b) {
    switch (D) {
    case 32: weighted_sum_pair(2, e_a, e_b, v_cache, bf16, offsets, n, out_a, out_b, total_a, total_b); return 1;
    case 64: weighted_sum_pair(4, e_a, e_b, v_cache, bf16, offsets, n, out_a, out_b, total_a, total_b); return 1;
    case 128: weighted_sum_pair(8, e_a, e_b, v_cache, bf16, offsets, n, out_a, out_b, total_a, total_b); return 1;
    default: return 0;
    }
}
#else
static int weighted_sum_registers(int64_t D, const float *e_a, const float *e_b, const void *v_cache, int bf16,
                                  const int64_t *offsets, int64_t n, float *out_a, float *out_b, float *total_a,
                                  float *total_b) {
    (void)D, (void)e_a, (void)e_b, (void)v_cache, (void)bf16, (void)offsets, (void)n, (void)out_a, (void)out_b;
    (void)total_a, (void)total_b;
    return 0;
}
#endif

/* All G query heads' scores against keys 0..n-1 into s (head g at s + g * n), each the dot()
   above: lane l sums the d = l mod 16 terms in order of d with fused multiply-adds from zero, then
   the lanes go through lane_tree. With AVX-512 and D a whole number of lane groups, sixteen keys
   go at once: their sixteen lane vectors are added level by level in one transposing tree whose
   every addition is one of lane_tree's (l + 8, + 4, + 2, + 1 of the same key), so each score has
   the same bits as one dot() at a time, without a horizontal reduction per key. `row` holds
   16 * Dp floats: the sixteen keys widened from bf16, or one row converted and padded (D < Dp). */
#if defined(__AVX512F__)
/* Lane i of the result: the lane_tree sum of v[i]'s 16 lanes, the score of key i (scores_by_16). */
static inline __m512 transposed_tree(const __m512 v[16]) {
    /* Inputs in the order A..P = keys 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15: after
       the four levels, lane i holds key i. */
    static const int order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) /* l += l + 8: lanes 0-7 of one key, then 0-7 of the next */
        l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[order[2 * i]], v[order[2 * i + 1]], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[order[2 * i]], v[order[2 * i + 1]], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* l += l + 4: four keys' lanes 0-3 */
        l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* l += l + 2: lanes 0-1 of two keys in each 128-bit quarter */
        l3[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(l2[2 * i]), _mm512_castps_pd(l2[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(l2[2 * i]), _mm512_castps_pd(l2[2 * i + 1]))));
    /* 0 + 1 */
    return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) void scores_by_16(int chunks, const float *restrict q, int64_t G,
                                                               const void *k_cache, int bf16,
                                                               const int64_t *restrict offsets, int64_t n,
                                                               float *restrict s, float *restrict keys) {
    const int64_t Dp = 16 * chunks, ahead = prefetch_ahead(bf16, Dp);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        const float *rows[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i >= m) { /* past the last key: zeros, whose scores are not stored */
                for (int c = 0; c < chunks; c++) _mm512_storeu_ps(keys + i * Dp + 16 * c, _mm512_setzero_ps());
                rows[i] = keys + i * Dp;
                continue;
            }
            if (j0 + i + ahead < n) prefetch_row(k_cache, bf16, offsets[j0 + i + ahead], Dp);
            if (!bf16) {
                rows[i] = (const float *)k_cache + offsets[j0 + i];
                continue;
            }
            const uint16_t *src = (const uint16_t *)k_cache + offsets[j0 + i];
            for (int c = 0; c < chunks; c++)
                _mm512_storeu_ps(keys + i * Dp + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16 * c))), 16)));
            rows[i] = keys + i * Dp;
        }
        const __mmask16 keep = (__mmask16)((1u << m) - 1u);
        for (int64_t g = 0; g < G; g++) {
            __m512 acc[16];
            const float *qg = q + g * Dp;
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
                for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows[i] + 16 * c), acc[i]);
            }
            _mm512_mask_storeu_ps(s + g * n + j0, keep, transposed_tree(acc));
        }
    }
}
#endif

static inline __attribute__((always_inline)) void scores_of(const float *restrict q, int64_t G, int64_t D, int64_t Dp,
                                                            const void *k_cache, int bf16,
                                                            const int64_t *restrict offsets, int64_t n,
                                                            float *restrict s, float *restrict row) {
#if defined(__AVX512F__)
    /* Up to head_dim 64, where the per-key trees cost as much as the multiply-adds: 1.05-1.23x on a
       call (benchmarks/bench_attention.py); at 128 the sixteen rows read once per head cost more
       than the trees saved (0.83-1.11x), so one key at a time, both heads per load, as before. */
    if (D == Dp && Dp <= 64) {
        scores_by_16((int)(Dp / 16), q, G, k_cache, bf16, offsets, n, s, row);
        return;
    }
#endif
    const int64_t ahead = prefetch_ahead(bf16, D);
    for (int64_t j = 0; j < n; j++) {
        if (j + ahead < n) prefetch_row(k_cache, bf16, offsets[j + ahead], D);
        const Row key = cache_row(k_cache, bf16, offsets[j], D, Dp, row);
        for (int64_t g = 0; g < G; g++) s[g * n + j] = dot_row(q + g * Dp, key, Dp);
    }
}

/* Runs fn on each of `count` jobs (an array of job_size-byte structs), one thread each; returns 2
   if a thread could not be started. Built with OpenMP, the threads are those of the OpenMP runtime
   torch has already loaded (the same libgomp.so.1, so the same pool): right after a torch op its
   workers are still spinning, and threads of our own would have to share the cores with them
   (measured: decode attention 2x slower on 2 threads than on 1; docs/benchmarks.md, ninth
   session). Which thread runs which job cannot change the bits: jobs never share an output. */
static int run_parallel(void *(*fn)(void *), void *jobs, size_t job_size, int count) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(count) schedule(static, 1)
    for (int i = 0; i < count; i++) fn((char *)jobs + (size_t)i * job_size);
    return 0;
#else
    pthread_t ids[64];
    int started = 0, status = 0;
    for (int i = 1; i < count; i++) {
        if (pthread_create(&ids[i], NULL, fn, (char *)jobs + (size_t)i * job_size) != 0) {
            status = 2;
            break;
        }
        started = i;
    }
    if (status == 0) fn(jobs);
    for (int i = 1; i <= started; i++) pthread_join(ids[i], NULL);
    return status;
#endif
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    int q_bf16, kv_bf16;
    const int64_t *block_tables, *token_seq, *token_pos;
    int64_t table_stride, H, Hkv, D, block;
    float scale;
    void *out; /* (tokens, H, D) fp32, or bf16 when out_bf16 (rounded as torch's .to(bfloat16)) */
    int out_bf16;
    int64_t first, last; /* work items [first, last): item = token * Hkv + kv_head */
    int status;
} Job;

/* BY_SIZE(n, call): `call` with SIZE bound to n, as a constant for the usual head and hidden
   sizes 32, 64 and 128. The work functions it calls are always inlined, so each size gets loops
   with constant trip counts: on rows this short, loops whose trip count is known only at run time
   spent more on their set-up than on their work (RMSNorm backward 2-3x, attention 7-19 %; the
   arithmetic, and so the bits, are the same for every size). */
#define BY_SIZE(n, call)                                                                            \
    do {                                                                                            \
        switch (n) {                                                                                \
        case 32: { const int64_t SIZE = 32; call; break; }                                          \
        case 64: { const int64_t SIZE = 64; call; break; }                                          \
        case 128: { const int64_t SIZE = 128; call; break; }                                        \
        default: { const int64_t SIZE = (n); call; }                                                \
        }                                                                                           \
    } while (0)

/* run_job's work items, inlined per head size (BY_SIZE) for the per-key loops' sake. */
static inline __attribute__((always_inline)) void run_items(Job *job, const int64_t D, float *scores, float *q, float *acc,
                                                            float *row, float *sums, int64_t *offsets) {
    const int64_t H = job->H, Hkv = job->Hkv, block = job->block, G = H / Hkv;
    const int64_t Dp = (D + LANES - 1) / LANES * LANES, ahead = prefetch_ahead(job->kv_bf16, D);
    for (int64_t item = job->first; item < job->last; item++) {
        const int64_t t = item / Hkv, h = item % Hkv, n = job->token_pos[t] + 1;
        const int64_t *table = job->block_tables + job->token_seq[t] * job->table_stride;
        for (int64_t g = 0; g < G; g++) {
            float *restrict qg = q + g * Dp;
            load_row(job->q, job->q_bf16, (t * H + h * G + g) * D, D, qg);
            for (int64_t d = 0; d < D; d++) qg[d] *= job->scale;
        }
        key_offsets(table, n, block, Hkv, h, D, offsets);
        /* The loops below prefetch `ahead` rows ahead of themselves; the first rows of the
           values, and of the next item's keys, are asked for here, so that they arrive while this
           item's scores are computed (the cache rows of a decode step come from L3 or memory:
           the weights' streaming evicts them between layers). */
        for (int64_t j = 0; j < n && j < ahead; j++) prefetch_row(job->v_cache, job->kv_bf16, offsets[j], D);
        if (item + 1 < job->last) {
            const int64_t t1 = (item + 1) / Hkv, h1 = (item + 1) % Hkv, n1 = job->token_pos[t1] + 1;
            const int64_t *table1 = job->block_tables + job->token_seq[t1] * job->table_stride;
            for (int64_t j = 0; j < n1 && j < ahead; j++)
                prefetch_row(job->k_cache, job->kv_bf16, ((table1[j / block] * block + j % block) * Hkv + h1) * D, D);
        }
        scores_of(q, G, D, Dp, job->k_cache, job->kv_bf16, offsets, n, scores, row);
        for (int64_t g = 0; g < G; g++) {
            float *restrict s = scores + g * n;
            const float top = max_of(s, n);
            for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
        }
        /* The weighted sums of V and the softmax sums (in position order, never reassociated) in
           one pass, two heads at a time. */
        int in_registers = 1;
        for (int64_t g = 0; g < G && in_registers; g += 2) {
            const int64_t g2 = g + 1 < G ? g + 1 : g; /* an odd last head is computed twice */
            in_registers = weighted_sum_registers(D, scores + g * n, scores + g2 * n, job->v_cache, job->kv_bf16,
                                                  offsets, n, acc + g * Dp, acc + g2 * Dp, sums + g, sums + g2);
        }
        if (!in_registers) {
            for (int64_t g = 0; g < G; g += 2) { /* two independent chains of additions overlap */
                const float *sa = scores + g * n, *sb = scores + (g + 1 < G ? g + 1 : g) * n;
                float sum_a = 0.0f, sum_b = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    sum_a += sa[j];
                    sum_b += sb[j];
                }
                sums[g] = sum_a;
                if (g + 1 < G) sums[g + 1] = sum_b;
            }
            memset(acc, 0, sizeof(float) * (size_t)(G * Dp));
            for (int64_t j = 0; j < n; j++) {
                const Row value = cache_row(job->v_cache, job->kv_bf16, offsets[j], D, Dp, row);
                for (int64_t g = 0; g < G; g++) axpy_row(acc + g * Dp, scores[g * n + j], value, Dp);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t dst = (t * H + h * G + g) * D;
            if (job->out_bf16) {
                uint16_t *restrict o16 = (uint16_t *)job->out + dst;
                for (int64_t d = 0; d < D; d++) o16[d] = float_to_bf16(acc[g * Dp + d] / sums[g]);
            } else {
                float *restrict o32 = (float *)job->out + dst;
                for (int64_t d = 0; d < D; d++) o32[d] = acc[g * Dp + d] / sums[g];
            }
        }
    }
}

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    const int64_t H = job->H, Hkv = job->Hkv, D = job->D, G = H / Hkv;
    const int64_t Dp = (D + LANES - 1) / LANES * LANES;
    int64_t longest = 1;
    for (int64_t item = job->first; item < job->last; item++) {
        int64_t n = job->token_pos[item / Hkv] + 1;
        if (n > longest) longest = n;
    }
    float *scores = malloc(sizeof(float) * (size_t)(G * longest));
    float *q = calloc((size_t)(G * Dp), sizeof(float));
    float *acc = malloc(sizeof(float) * (size_t)(G * Dp));
    float *row = calloc((size_t)(16 * Dp), sizeof(float)); /* scores_of's work rows */
    float *sums = malloc(sizeof(float) * (size_t)G);
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)longest);
    if (!scores || !q || !acc || !row || !sums || !offsets) {
        job->status = 1;
        goto done;
    }
    BY_SIZE(job->D, run_items(job, SIZE, scores, q, acc, row, sums, offsets));
done:
    free(scores);
    free(q);
    free(acc);
    free(row);
    free(sums);
    free(offsets);
    return NULL;
}

static int attention_jobs(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
                          const int64_t *token_pos, int64_t tokens, int64_t H, int64_t Hkv, int64_t D, int64_t block,
                          float scale, void *out, int out_bf16, int threads) {
    const int64_t items = tokens * Hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items > 0 ? (int)items : 1;
    Job jobs[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++) {
        jobs[i] = (Job){q, k_cache, v_cache, q_bf16, kv_bf16, block_tables, token_seq, token_pos,
                        table_stride, H, Hkv, D, block, scale, out, out_bf16,
                        items * i / threads, items * (i + 1) / threads, 0};
    }
    int status = run_parallel(run_job, jobs, sizeof(Job), threads);
    for (int i = 0; i < threads && status == 0; i++) status = jobs[i].status;
    return status;
}

/* Returns 0 on success, 1 if memory ran out, 2 if a thread could not be started. out: fp32. */
int rz_attention(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int kv_bf16,
                 const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
                 const int64_t *token_pos, int64_t tokens, int64_t H, int64_t Hkv, int64_t D, int64_t block,
                 float scale, float *out, int threads) {
    return attention_jobs(q, q_bf16, k_cache, v_cache, kv_bf16, block_tables, table_stride, token_seq, token_pos,
                          tokens, H, Hkv, D, block, scale, out, 0, threads);
}

/* ---------------------------------------------------------------------------------------------
   Backward (training only). It needs the right gradients, not batch-invariant ones, so its
   order is free; it recomputes the probabilities from q and K instead of storing them. One work
   unit is one (sequence, KV head): its tokens' dK and dV rows are its own, so threads never
   write the same element (the caller runs one thread when sequences share cache blocks). */

typedef struct {
    const void *q, *k_cache, *v_cache;
    int q_bf16, kv_bf16;
    const int64_t *block_tables, *token_seq, *token_pos, *seq_starts; /* seq_starts: B + 1 token offsets */
    const float *grad; /* (tokens, H, D) fp32 */
    int64_t table_stride, H, Hkv, D, block;
    float scale;
    float *dq, *dk, *dv; /* dq (tokens, H, D); dk, dv like the caches, fp32, zeroed by the caller */
    int64_t num_seqs;
    int64_t first, last; /* units [first, last): unit = kv_head * num_seqs + sequence */
    int status;
} BackwardJob;

/* run_backward's work units, inlined per head size (BY_SIZE). */
static inline __attribute__((always_inline)) void backward_units(BackwardJob *job, const int64_t D, float *p, float *dp,
                                                                 float *q, float *go, float *dq, float *row,
                                                                 float *weighted, int64_t *offsets) {
    const int64_t H = job->H, Hkv = job->Hkv, block = job->block, G = H / Hkv;
    const int64_t Dp = (D + LANES - 1) / LANES * LANES, ahead = prefetch_ahead(job->kv_bf16, D);
    for (int64_t unit = job->first; unit < job->last; unit++) {
        const int64_t b = unit % job->num_seqs, h = unit / job->num_seqs;
        for (int64_t t = job->seq_starts[b]; t < job->seq_starts[b + 1]; t++) {
            const int64_t n = job->token_pos[t] + 1;
            const int64_t *table = job->block_tables + job->token_seq[t] * job->table_stride;
            for (int64_t g = 0; g < G; g++) {
                const int64_t qrow = (t * H + h * G + g) * D;
                load_row(job->q, job->q_bf16, qrow, D, q + g * Dp);
                for (int64_t d = 0; d < D; d++) q[g * Dp + d] *= job->scale;
                memcpy(go + g * Dp, job->grad + qrow, sizeof(float) * (size_t)D);
            }
            key_offsets(table, n, block, Hkv, h, D, offsets);
            /* Scores, then probabilities, as in the forward (up to the division's rounding). */
            scores_of(q, G, D, Dp, job->k_cache, job->kv_bf16, offsets, n, p, row);
            for (int64_t g = 0; g < G; g++) {
                float *pg = p + g * n, sum = 0.0f;
                const float top = max_of(pg, n);
                for (int64_t j = 0; j < n; j++) pg[j] = exp_nonpositive(pg[j] - top);
                for (int64_t j = 0; j < n; j++) sum += pg[j];
                const float inverse = 1.0f / sum;
                for (int64_t j = 0; j < n; j++) pg[j] *= inverse;
                weighted[g] = 0.0f;
            }
            /* dP = dO . v_j and the softmax backward's row term sum_j p_j dP_j. */
            for (int64_t j = 0; j < n; j++) {
                if (j + ahead < n) prefetch_row(job->v_cache, job->kv_bf16, offsets[j + ahead], D);
                const Row value = cache_row(job->v_cache, job->kv_bf16, offsets[j], D, Dp, row);
                for (int64_t g = 0; g < G; g++) {
                    dp[g * n + j] = dot_row(go + g * Dp, value, Dp);
                    weighted[g] += p[g * n + j] * dp[g * n + j];
                }
            }
            /* dS = P (dP - row term), in place of dP. */
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++) dp[g * n + j] = p[g * n + j] * (dp[g * n + j] - weighted[g]);
            /* dQ = dS K: the forward's weighted sum, with dS for weights and K for values. */
            int in_registers = 1;
            for (int64_t g = 0; g < G && in_registers; g += 2) {
                const int64_t g2 = g + 1 < G ? g + 1 : g;
                in_registers = weighted_sum_registers(D, dp + g * n, dp + g2 * n, job->k_cache, job->kv_bf16, offsets, n,
                                                      dq + g * Dp, dq + g2 * Dp, NULL, NULL);
            }
            if (!in_registers) {
                memset(dq, 0, sizeof(float) * (size_t)(G * Dp));
                for (int64_t j = 0; j < n; j++) {
                    const Row key = cache_row(job->k_cache, job->kv_bf16, offsets[j], D, Dp, row);
                    for (int64_t g = 0; g < G; g++) axpy_row(dq + g * Dp, dp[g * n + j], key, D);
                }
            }
            /* dK_j += sum_g dS_gj q_g and dV_j += sum_g P_gj dO_g: one pass over each row for all heads. */
            for (int64_t j = 0; j < n; j++) {
                float *restrict dk = job->dk + offsets[j], *restrict dv = job->dv + offsets[j];
                for (int64_t g = 0; g < G; g += 2) {
                    const int64_t g2 = g + 1 < G ? g + 1 : g;
                    const float ds_a = dp[g * n + j], ds_b = g2 != g ? dp[g2 * n + j] : 0.0f;
                    const float p_a = p[g * n + j], p_b = g2 != g ? p[g2 * n + j] : 0.0f;
                    const float *restrict qa = q + g * Dp, *restrict qb = q + g2 * Dp;
                    const float *restrict ga = go + g * Dp, *restrict gb = go + g2 * Dp;
                    for (int64_t d = 0; d < D; d++) {
                        dk[d] = fmaf(ds_b, qb[d], fmaf(ds_a, qa[d], dk[d]));
                        dv[d] = fmaf(p_b, gb[d], fmaf(p_a, ga[d], dv[d]));
                    }
                }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) job->dq[(t * H + h * G + g) * D + d] = dq[g * Dp + d] * job->scale;
        }
    }
}

static void *run_backward(void *arg) {
    BackwardJob *job = (BackwardJob *)arg;
    const int64_t H = job->H, Hkv = job->Hkv, D = job->D, G = H / Hkv;
    const int64_t Dp = (D + LANES - 1) / LANES * LANES;
    int64_t longest = 1;
    for (int64_t unit = job->first; unit < job->last; unit++) {
        const int64_t b = unit % job->num_seqs;
        for (int64_t t = job->seq_starts[b]; t < job->seq_starts[b + 1]; t++)
            if (job->token_pos[t] + 1 > longest) longest = job->token_pos[t] + 1;
    }
    /* Per (token, KV head): p and dp hold G rows of `longest` keys; q, go, dq hold G rows of Dp. */
    float *p = malloc(sizeof(float) * (size_t)(G * longest));
    float *dp = malloc(sizeof(float) * (size_t)(G * longest));
    float *q = calloc((size_t)(G * Dp), sizeof(float));
    float *go = calloc((size_t)(G * Dp), sizeof(float));
    float *dq = malloc(sizeof(float) * (size_t)(G * Dp));
    float *row = calloc((size_t)(16 * Dp), sizeof(float)); /* scores_of's work rows */
    float *weighted = malloc(sizeof(float) * (size_t)G);
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)longest);
    if (!p || !dp || !q || !go || !dq || !row || !weighted || !offsets) {
        job->status = 1;
        goto done;
    }
    BY_SIZE(job->D, backward_units(job, SIZE, p, dp, q, go, dq, row, weighted, offsets));
done:
    free(p);
    free(dp);
    free(q);
    free(go);
    free(dq);
    free(row);
    free(weighted);
    free(offsets);
    return NULL;
}

int rz_attention_backward(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
                          const int64_t *token_pos, const int64_t *seq_starts, int64_t num_seqs,
                          const float *grad, int64_t H, int64_t Hkv, int64_t D, int64_t block, float scale,
                          float *dq, float *dk, float *dv, int threads, int shared) {
    const int64_t units = num_seqs * Hkv;
    if (units == 0) return 0;
    if (threads < 1) threads = 1;
    /* Sequences that share cache blocks add into the same dK/dV rows: then each thread takes whole
       KV heads (a head's rows are its own), so a row's additions come in sequence order on one
       thread, the order of a one-thread run: the same bits for every thread count. */
    const int64_t parts = shared ? Hkv : units;
    if (threads > parts) threads = parts > 0 ? (int)parts : 1;
    if (threads > 64) threads = 64;
    BackwardJob jobs[64];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (BackwardJob){q, k_cache, v_cache, q_bf16, kv_bf16, block_tables, token_seq, token_pos, seq_starts,
                                grad, table_stride, H, Hkv, D, block, scale, dq, dk, dv, num_seqs,
                                units / parts * (parts * i / threads), units / parts * (parts * (i + 1) / threads), 0};
    }
    int status = run_parallel(run_backward, jobs, sizeof(BackwardJob), threads);
    for (int i = 0; i < threads && status == 0; i++) status = jobs[i].status;
    return status;
}

/* ---------------------------------------------------------------------------------------------
   RMSNorm forward, one row at a time in one fixed order (the training backward is plain torch
   math): sum of squares as a 16-lane dot product (above), mean = sum / N, r = 1 / sqrt(mean +
   eps), normed = x * r rounded to the input dtype, out = weight * normed in that dtype. Rows are
   (outer, inner) with their own strides, so a (tokens, heads, head_dim) view of a fused
   projection needs no copy. */

/* One row of N values at x + offset into out + dst (the input's dtype): w holds the weight in
   fp32, row is a scratch of Np floats, zero past N (its padding adds exact zeros to the dot). */
static inline void rms_norm_row(const void *x, int bf16, int64_t offset, int64_t N, int64_t Np, const float *w,
                                float eps, float *restrict row, void *out, int64_t dst) {
    load_row(x, bf16, offset, N, row);
    const float r = 1.0f / sqrtf(dot(row, row, Np) / (float)N + eps);
    if (bf16) {
        uint16_t *restrict o16 = (uint16_t *)out + dst;
        for (int64_t d = 0; d < N; d++) o16[d] = float_to_bf16(w[d] * rounded_bf16(row[d] * r));
    } else {
        float *restrict o32 = (float *)out + dst;
        for (int64_t d = 0; d < N; d++) o32[d] = w[d] * (row[d] * r);
    }
}

/* The rows of one RMSNorm call that one thread takes: [first, last) of outer * inner, row r at
   outer index r / inner and inner index r % inner. Rows are independent in the forward, so any
   split gives each row the same bits; the backward's weight gradient sums per thread, then the
   threads' sums in thread order (its bits follow the thread count, as the GEMMs' do). */
typedef struct {
    const void *x;
    int bf16;
    int64_t inner, stride_outer, stride_inner, N;
    const void *weight;
    float eps;
    void *out;                  /* forward */
    const float *grad;          /* backward */
    float *grad_x, *grad_w;     /* backward: grad_w this thread's own sum, or NULL */
    int64_t first, last;
    int status;
} NormJob;

/* From this many elements per thread on, a call splits its rows over the threads (below it the
   threads' start costs more than the rows: an engine step's 64 rows stay on one). */
#define NORM_ELEMENTS_PER_THREAD 16384

static int norm_threads(int64_t rows, int64_t N, int threads) {
    const int64_t most = rows * N / NORM_ELEMENTS_PER_THREAD;
    if (threads > most) threads = most > 1 ? (int)most : 1;
    return threads > 64 ? 64 : threads;
}

static inline __attribute__((always_inline)) void norm_rows(const NormJob *job, const int64_t N, const float *w, float *row) {
    const int64_t Np = (N + LANES - 1) / LANES * LANES;
    for (int64_t r = job->first; r < job->last; r++)
        rms_norm_row(job->x, job->bf16, r / job->inner * job->stride_outer + r % job->inner * job->stride_inner, N, Np, w,
                     job->eps, row, job->out, r * N);
}

static void *run_norm(void *arg) {
    NormJob *job = (NormJob *)arg;
    const int64_t N = job->N, Np = (N + LANES - 1) / LANES * LANES;
    float *row = calloc((size_t)Np, sizeof(float));
    float *w = malloc(sizeof(float) * (size_t)N);
    if (!row || !w) {
        job->status = 1;
    } else {
        load_row(job->weight, job->bf16, 0, N, w);
        BY_SIZE(N, norm_rows(job, SIZE, w, row));
    }
    free(row);
    free(w);
    return NULL;
}

int rz_rms_norm(const void *x, int bf16, int64_t outer, int64_t inner, int64_t stride_outer, int64_t stride_inner,
                int64_t N, const void *weight, float eps, void *out, int threads) {
    const int64_t rows = outer * inner;
    threads = norm_threads(rows, N, threads);
    NormJob jobs[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (NormJob){x, bf16, inner, stride_outer, stride_inner, N, weight, eps, out, NULL, NULL, NULL,
                            rows * i / threads, rows * (i + 1) / threads, 0};
    int status = run_parallel(run_norm, jobs, sizeof(NormJob), threads);
    for (int i = 0; i < threads && status == 0; i++) status = jobs[i].status;
    return status;
}

/* The backward of rows [first, last): row, gw (Np floats, zero past N) and w (N floats) are the
   thread's buffers, grad_w its sums (or NULL). Inlined per row size (BY_SIZE). */
static inline __attribute__((always_inline)) void norm_backward_rows(const NormJob *job, const int64_t N,
                                                                     float *restrict row, const float *restrict w,
                                                                     float *restrict gw, float *restrict grad_w) {
    const int64_t Np = (N + LANES - 1) / LANES * LANES;
    for (int64_t r = job->first; r < job->last; r++) {
        load_row(job->x, job->bf16, r / job->inner * job->stride_outer + r % job->inner * job->stride_inner, N, row);
        const float rinv = 1.0f / sqrtf(dot(row, row, Np) / (float)N + job->eps);
        const float *restrict g = job->grad + r * N;
        for (int64_t d = 0; d < N; d++) row[d] *= rinv; /* normed */
        if (grad_w)
            for (int64_t d = 0; d < N; d++) grad_w[d] += g[d] * row[d];
        if (job->grad_x) {
            /* In 16 lanes (`dot`), not one sequential chain: a chain of N dependent additions
               made this backward ~100 us per call on the tiny model's rows. */
            for (int64_t d = 0; d < N; d++) gw[d] = g[d] * w[d];
            const float projection = dot(gw, row, Np) / (float)N;
            float *restrict gx = job->grad_x + r * N;
            for (int64_t d = 0; d < N; d++) gx[d] = rinv * (gw[d] - row[d] * projection);
        }
    }
}

static void *run_norm_backward(void *arg) {
    NormJob *job = (NormJob *)arg;
    const int64_t N = job->N, Np = (N + LANES - 1) / LANES * LANES;
    float *row = calloc((size_t)Np, sizeof(float));
    float *w = malloc(sizeof(float) * (size_t)N);
    float *gw = calloc((size_t)Np, sizeof(float)); /* g * w, zero past N like row */
    if (!row || !w || !gw) {
        job->status = 1;
        goto done;
    }
    load_row(job->weight, job->bf16, 0, N, w);
    BY_SIZE(N, norm_backward_rows(job, SIZE, row, w, gw, job->grad_w));
done:
    free(row);
    free(w);
    free(gw);
    return NULL;
}

/* RMSNorm backward (training only: the right gradients, no invariance needed). grad rows are
   contiguous fp32; grad_x (fp32, contiguous) and grad_w (fp32, N, zeroed by the caller: each
   thread's rows summed in order, then the threads' sums in order) are written only when wanted. */
int rz_rms_norm_backward(const void *x, int bf16, int64_t outer, int64_t inner, int64_t stride_outer,
                         int64_t stride_inner, int64_t N, const void *weight, float eps, const float *grad,
                         float *grad_x, float *grad_w, int threads) {
    const int64_t rows = outer * inner;
    threads = norm_threads(rows, N, threads);
    /* One thread sums into grad_w itself; several into their own zeroed sums, added in order after. */
    float *sums = grad_w && threads > 1 ? calloc((size_t)(threads * N), sizeof(float)) : NULL;
    if (grad_w && threads > 1 && !sums) return 1;
    NormJob jobs[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (NormJob){x, bf16, inner, stride_outer, stride_inner, N, weight, eps, NULL, grad, grad_x,
                            sums ? sums + i * N : grad_w, rows * i / threads, rows * (i + 1) / threads, 0};
    int status = run_parallel(run_norm_backward, jobs, sizeof(NormJob), threads);
    for (int i = 0; i < threads && status == 0; i++) status = jobs[i].status;
    if (sums) {
        for (int i = 0; i < threads; i++)
            for (int64_t d = 0; d < N; d++) grad_w[d] += sums[i * N + d];
        free(sums);
    }
    return status;
}

/* ---------------------------------------------------------------------------------------------
   Rotary embedding (rotate-half convention): out = x * cos + rotate(x) * sin, rotate(x) =
   (-x[half:], x[:half]), in one pass instead of five tensor ops, with PyTorch's own rounding: in
   bf16 each product and the sum are computed in fp32 and rounded to bf16 (as torch's bf16 ops
   are), in fp32 each is one fp32 operation (no fused multiply-add: -ffp-contract=off). So the
   bits are the torch expression's (tests/test_cpu_kernel.py). x and out: (T, H, D), cos and sin:
   (T, D), all contiguous. */


/* One half of a row: out[d] = x[d] * c[d] + sign * x[d + shift] * s[d] for d in [0, n); a loop
   without branches, which the compiler vectorises. */
static inline void rotary_half_bf16(const uint16_t *restrict x, const uint16_t *restrict partner, float sign,
                                    const uint16_t *restrict c, const uint16_t *restrict s, int64_t n,
                                    uint16_t *restrict o) {
    for (int64_t d = 0; d < n; d++) {
        const float a = rounded_bf16(bf16_value(x[d]) * bf16_value(c[d]));
        const float b = rounded_bf16((sign * bf16_value(partner[d])) * bf16_value(s[d]));
        o[d] = float_to_bf16(a + b);
    }
}

static inline void rotary_half_f32(const float *restrict x, const float *restrict partner, float sign,
                                   const float *restrict c, const float *restrict s, int64_t n, float *restrict o) {
    for (int64_t d = 0; d < n; d++) o[d] = x[d] * c[d] + (sign * partner[d]) * s[d];
}

/* One row of D values: x + xo into out + oo, with the cos and sin rows at c + co. */
static inline void rotary_row(const void *x, int bf16, int64_t xo, const void *cos, const void *sin, int64_t co,
                              int64_t D, void *out, int64_t oo) {
    const int64_t half = D / 2;
    /* rotate(x) is -x[d + half] in the first half and x[d - half] in the second; the sign flip is
       exact (sign * v with sign = +-1 is v or -v), so it rounds as torch's neg. */
    if (bf16) {
        const uint16_t *xr = (const uint16_t *)x + xo, *c = (const uint16_t *)cos + co, *s = (const uint16_t *)sin + co;
        uint16_t *o = (uint16_t *)out + oo;
        rotary_half_bf16(xr, xr + half, -1.0f, c, s, half, o);
        rotary_half_bf16(xr + half, xr, 1.0f, c + half, s + half, D - half, o + half);
    } else {
        const float *xr = (const float *)x + xo, *c = (const float *)cos + co, *s = (const float *)sin + co;
        float *o = (float *)out + oo;
        rotary_half_f32(xr, xr + half, -1.0f, c, s, half, o);
        rotary_half_f32(xr + half, xr, 1.0f, c + half, s + half, D - half, o + half);
    }
}

int rz_rotary(const void *x, int bf16, const void *cos, const void *sin, int64_t T, int64_t H, int64_t D, void *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) rotary_row(x, bf16, (t * H + h) * D, cos, sin, t * D, D, out, (t * H + h) * D);
    return 0;
}

/* Rotary backward (training): grad_x = grad * cos + rotate^T(grad * sin), rotate^T(y) =
   (y[half:], -y[:half]): the torch expression's gradient with its rounding (each product, then the
   sum, in the dtype), so the same bits as autograd of that expression, in one pass. */
static inline void rotary_backward_row(const void *grad, int bf16, int64_t go, const void *cos, const void *sin,
                                       int64_t co, int64_t D, void *out) {
    const int64_t half = D / 2;
    if (bf16) {
        const uint16_t *g = (const uint16_t *)grad + go, *c = (const uint16_t *)cos + co, *s = (const uint16_t *)sin + co;
        uint16_t *o = (uint16_t *)out + go;
        for (int64_t d = 0; d < half; d++)
            o[d] = float_to_bf16(rounded_bf16(bf16_value(g[d]) * bf16_value(c[d])) +
                                 rounded_bf16(bf16_value(g[d + half]) * bf16_value(s[d + half])));
        for (int64_t d = half; d < D; d++)
            o[d] = float_to_bf16(rounded_bf16(bf16_value(g[d]) * bf16_value(c[d])) +
                                 -rounded_bf16(bf16_value(g[d - half]) * bf16_value(s[d - half])));
    } else {
        const float *g = (const float *)grad + go, *c = (const float *)cos + co, *s = (const float *)sin + co;
        float *o = (float *)out + go;
        for (int64_t d = 0; d < half; d++) o[d] = g[d] * c[d] + g[d + half] * s[d + half];
        for (int64_t d = half; d < D; d++) o[d] = g[d] * c[d] + -(g[d - half] * s[d - half]);
    }
}

int rz_rotary_backward(const void *grad, int bf16, const void *cos, const void *sin, int64_t T, int64_t H, int64_t D,
                       void *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) rotary_backward_row(grad, bf16, (t * H + h) * D, cos, sin, t * D, D, out);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
   The engine's attention step in one call: for each token, RMSNorm and rotary of its query and key
   heads, its keys and values written to their cache slots, then the attention above, its output
   in the tokens' dtype (padding rows 0). Each step is the arithmetic of the op it replaces
   (rms_norm_row, rotary_row, a copy, the attention jobs, torch's rounding to bf16), in the same
   order, so the bits are those of the separate ops (tests/test_cpu_kernel.py); only the calls and
   the intermediate tensors are saved. q, k, v: rows of H, Hkv, Hkv heads of D values, `*_stride`
   elements apart (views of the fused q/k/v projection); cos, sin: (tokens, D); q_rot: a
   (tokens, H, D) scratch; out: (padded, H, D). */
int rz_cached_attention(const void *q, const void *k, const void *v, int64_t q_stride, int64_t k_stride,
                        int64_t v_stride, int bf16, const void *q_weight, const void *k_weight, float eps,
                        const void *cos, const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
                        void *q_rot, const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
                        const int64_t *token_pos, int64_t tokens, int64_t padded, int64_t H, int64_t Hkv, int64_t D,
                        int64_t block, float scale, void *out, int threads) {
    const int64_t Dp = (D + LANES - 1) / LANES * LANES, size = bf16 ? 2 : 4;
    float *row = calloc((size_t)Dp, sizeof(float));
    float *qw = malloc(sizeof(float) * (size_t)D), *kw = malloc(sizeof(float) * (size_t)D);
    void *normed = malloc((size_t)(D * size));
    if (!row || !qw || !kw || !normed) {
        free(row);
        free(qw);
        free(kw);
        free(normed);
        return 1;
    }
    load_row(q_weight, bf16, 0, D, qw);
    load_row(k_weight, bf16, 0, D, kw);
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < H; h++) {
            rms_norm_row(q, bf16, t * q_stride + h * D, D, Dp, qw, eps, row, normed, 0);
            rotary_row(normed, bf16, 0, cos, sin, t * D, D, q_rot, (t * H + h) * D);
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t slot = (slots[t] * Hkv + h) * D;
            rms_norm_row(k, bf16, t * k_stride + h * D, D, Dp, kw, eps, row, normed, 0);
            rotary_row(normed, bf16, 0, cos, sin, t * D, D, k_cache, slot);
            memcpy((char *)v_cache + slot * size, (const char *)v + (t * v_stride + h * D) * size, (size_t)(D * size));
        }
    }
    free(row);
    free(qw);
    free(kw);
    free(normed);
    memset((char *)out + tokens * H * D * size, 0, (size_t)((padded - tokens) * H * D * size));
    return attention_jobs(q_rot, bf16, k_cache, v_cache, bf16, block_tables, table_stride, token_seq, token_pos, tokens,
                          H, Hkv, D, block, scale, out, bf16, threads);
}

/* ---------------------------------------------------------------------------------------------
   log_softmax and the sampler's draw, rzero's own numerics on the CPU (rzero/ops/invariant_rows.py,
   rzero/ops/sampling.py): every step written out below, with no libm call and fmaf exact by
   definition, so a row's bits depend on nothing but the row: not the batch, not the threads, not the
   machine (torch's CPU log_softmax and exp differ with the vector code the CPU gets).

   log_softmax: out_j = (x_j - m) - log(s), m the row's largest element (NaN if it has one), s the sum
   of exp(x_j - m) over j in 16 lanes (lane l the j = l mod 16 terms in order of j, from zero) added
   in lane_tree's order; exp is exp_nonpositive, log is log_of_sum below.

   The draw: for each row of logprobs (rows x V), the first token whose running sum of exp(lp_j), in
   order of j (a double accumulator, each prefix rounded to fp32), passes uniform * the row's total
   (its last prefix; the product rounded to fp32): a binary search over the prefixes (for a row that
   is not sorted, e.g. one with a NaN, the index its midpoints lead to). Rows go four at a time so
   that four independent chains of additions overlap (each row's keeps its order). */

/* log(s) for a sum of exponentials (s >= 1: the largest term is exp(0)); NaN and infinity pass. s =
   2^e * m, m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172, by
   its series to t^11 (the next term is below 1e-11 of t); plus e * ln2 in two parts. */
static inline float log_of_sum(float s) {
    if (!(s < INFINITY)) return s;
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    int32_t e = (int32_t)(bits >> 23) - 127;
    bits = (bits & 0x007fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    if (m > 1.41421356237f) {
        m *= 0.5f;
        e += 1;
    }
    const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    float p = 1.0f / 11.0f;
    p = fmaf(p, t2, 1.0f / 9.0f);
    p = fmaf(p, t2, 1.0f / 7.0f);
    p = fmaf(p, t2, 1.0f / 5.0f);
    p = fmaf(p, t2, 1.0f / 3.0f);
    const float log_m = 2.0f * fmaf(t * t2, p, t);
    return fmaf((float)e, 0.693145751953125f, fmaf((float)e, 1.42860682030941723212e-6f, log_m));
}

/* exp of a logprob or shifted logit (<= 0), NaN kept */
static inline float exp_of_logprob(float x) { return x != x ? x : exp_nonpositive(x); }

#if defined(__AVX512F__)
/* exp_of_logprob of sixteen lanes: the same operations, so the same bits. */
static inline __m512 exp_of_logprob16(__m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* NaN lanes: replaced below */
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), magic), magic);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), clamped);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
    __m512 e = _mm512_mul_ps(p, scale);
    e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), e, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }
#endif

static void log_softmax_row(const float *restrict x, int64_t V, float *restrict out) {
    float m = x[0], lanes[LANES] = {0};
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(x[0]);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 k = tail_mask(V - j);
        const __m512 v = _mm512_mask_loadu_ps(top, k, x + j);
        top = _mm512_max_ps(top, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    m = nan ? NAN : _mm512_reduce_max_ps(top);
#else
    for (int64_t j = 1; j < V; j++) m = (x[j] > m || x[j] != x[j]) ? x[j] : m;
#endif
    if (m != m) {
        for (int64_t j = 0; j < V; j++) out[j] = m;
        return;
    }
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(m);
    for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 k = tail_mask(V - j);
        const __m512 e = exp_of_logprob16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), shift));
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    _mm512_storeu_ps(lanes, acc);
#else
    int64_t j0 = 0;
    for (; j0 + LANES <= V; j0 += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += exp_of_logprob(x[j0 + l] - m);
    for (int64_t j = j0; j < V; j++) lanes[j - j0] += exp_of_logprob(x[j] - m);
#endif
    const float lse = log_of_sum(lane_tree(lanes));
    for (int64_t j = 0; j < V; j++) out[j] = (x[j] - m) - lse;
}

/* probs[j] = exp_of_logprob(lp[j]) for j < V */
static void exp_row(const float *restrict lp, int64_t V, float *restrict probs) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= V; j += 16) _mm512_storeu_ps(probs + j, exp_of_logprob16(_mm512_loadu_ps(lp + j)));
#endif
    for (; j < V; j++) probs[j] = exp_of_logprob(lp[j]);
}

typedef struct {
    const float *x;
    float *out;
    int64_t V, ldx, first, last; /* rows [first, last) */
} LogSoftmaxJob;

static void *run_log_softmax(void *arg) {
    const LogSoftmaxJob *job = (const LogSoftmaxJob *)arg;
    for (int64_t r = job->first; r < job->last; r++) log_softmax_row(job->x + r * job->ldx, job->V, job->out + r * job->V);
    return NULL;
}

/* out (rows, V) contiguous = log_softmax of each row of x (row r at x + r * ldx). */
int rz_log_softmax(const float *x, int64_t rows, int64_t V, int64_t ldx, float *out, int threads) {
    if (threads < 1) threads = 1;
    if (rows * V < (1 << 16)) threads = 1; /* below this the threads' start costs more than they save */
    if (threads > rows) threads = rows > 0 ? (int)rows : 1;
    if (threads > 64) threads = 64;
    LogSoftmaxJob jobs[64];
    for (int i = 0; i < threads; i++) jobs[i] = (LogSoftmaxJob){x, out, V, ldx, rows * i / threads, rows * (i + 1) / threads};
    return run_parallel(run_log_softmax, jobs, sizeof(LogSoftmaxJob), threads);
}

typedef struct {
    const float *logprobs, *uniform;
    float *scratch;
    int64_t *out;
    int64_t V, first, last; /* rows [first, last) */
} ScanJob;

static void scan_rows(const float *logprobs, int64_t V, const float *uniform, float *scratch, int64_t *out,
                      int64_t count) {
    const float *p[4];
    for (int64_t i = 0; i < 4; i++) p[i] = logprobs + (i < count ? i : count - 1) * V;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int64_t i = 0; i < (count == 1 ? 1 : 4); i++) exp_row(p[i], V, scratch + i * V); /* then scans in place */
    if (count == 1) { /* one row: one chain, the others would only repeat it */
        for (int64_t j = 0; j < V; j++) {
            a0 += (double)scratch[j];
            scratch[j] = (float)a0;
        }
    } else {
        for (int64_t j = 0; j < V; j++) {
            a0 += (double)scratch[j];
            a1 += (double)scratch[V + j];
            a2 += (double)scratch[2 * V + j];
            a3 += (double)scratch[3 * V + j];
            scratch[j] = (float)a0;
            scratch[V + j] = (float)a1;
            scratch[2 * V + j] = (float)a2;
            scratch[3 * V + j] = (float)a3;
        }
    }
    for (int64_t i = 0; i < count; i++) {
        const float *cumulative = scratch + i * V;
        const float threshold = uniform[i] * cumulative[V - 1];
        int64_t lo = 0, hi = V;
        while (lo < hi) {
            const int64_t mid = lo + ((hi - lo) >> 1);
            if (!(cumulative[mid] > threshold))
                lo = mid + 1;
            else
                hi = mid;
        }
        out[i] = lo;
    }
}

static void *run_scan(void *arg) {
    ScanJob *job = (ScanJob *)arg;
    for (int64_t r = job->first; r < job->last; r += 4) {
        const int64_t count = job->last - r < 4 ? job->last - r : 4;
        scan_rows(job->logprobs + r * job->V, job->V, job->uniform + r, job->scratch, job->out + r, count);
    }
    return NULL;
}

/* scratch: threads * 4 * V floats. */
int rz_inverse_cdf(const float *logprobs, int64_t rows, int64_t V, const float *uniform, float *scratch, int64_t *out,
                   int threads) {
    const int64_t groups = (rows + 3) / 4;
    if (threads < 1) threads = 1;
    if (threads > groups) threads = groups > 0 ? (int)groups : 1;
    if (threads > 64) threads = 64;
    ScanJob jobs[64];
    for (int i = 0; i < threads; i++) {
        const int64_t first = groups * i / threads * 4, last = groups * (i + 1) / threads * 4;
        jobs[i] = (ScanJob){logprobs, uniform, scratch + (int64_t)i * 4 * V, out, V, first, last < rows ? last : rows};
    }
    return run_parallel(run_scan, jobs, sizeof(ScanJob), threads);
}

/* The invariant bf16 linear on CPUs with avx512_bf16 (rzero/ops/gemm_route.py, `bf16_kernel`):
   out (M, N) bf16 = x (M, K) bf16 times W^T, W (N, K) prepacked by rz_bf16_pack into panels of 32
   columns whose k-pairs interleave ([panel][K / 2][32][2], zero columns past N; K even). Each
   output element is one sum, on one thread, over the k-pairs in order from k = 0, each pair added
   the way `vdpbf16ps` adds it: the odd product, then the even one, each addition rounded to fp32,
   inputs and results flushed to zero when denormal; the sum is then rounded to bf16 (nearest
   even). Nothing else enters an element: not the other rows, not M, not the threads (each takes
   whole 6-row x 32-column tiles). tests/test_cpu_kernel.py checks these bits against that
   definition written out in torch. Why a GEMM of our own: oneDNN's bf16 GEMM costs ~12 us a call
   before any work at an engine step's shapes, and this kernel runs them at the instruction's
   rate (docs/benchmarks.md, fourteenth session). */
#define GEMM_ROWS 6
#define GEMM_COLS 32
/* From this many multiply-adds per thread on, a call splits its tiles over the threads (below it
   the threads' start costs more than they save). */
#define GEMM_MACS_PER_THREAD (1 << 20)

/* The threads an (M, K) x (K, N) GEMM of `*tiles` 6 x 32 tiles runs on (at most `threads`, 64). */
static int gemm_threads(int64_t M, int64_t K, int64_t N, int threads, int64_t *tiles) {
    *tiles = (M + GEMM_ROWS - 1) / GEMM_ROWS * ((N + GEMM_COLS - 1) / GEMM_COLS);
    const int64_t most = M * N * K / GEMM_MACS_PER_THREAD;
    if (threads > most) threads = most > 1 ? (int)most : 1;
    if (threads > *tiles) threads = *tiles > 0 ? (int)*tiles : 1;
    return threads > 64 ? 64 : threads;
}

int rz_bf16_pack(const uint16_t *w, int64_t N, int64_t K, int64_t stride_n, int64_t stride_k, uint16_t *out) {
    if (K % 2) return 4;
    const int64_t panels = (N + GEMM_COLS - 1) / GEMM_COLS, pairs = K / 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < GEMM_COLS; j++) {
                const int64_t n = p * GEMM_COLS + j;
                uint16_t *dst = out + ((p * pairs + kk) * GEMM_COLS + j) * 2;
                dst[0] = n < N ? w[n * stride_n + 2 * kk * stride_k] : 0;
                dst[1] = n < N ? w[n * stride_n + (2 * kk + 1) * stride_k] : 0;
            }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
typedef struct {
    const uint16_t *x, *packed;
    uint16_t *out;
    int64_t M, K, N, lda, first, last; /* tiles [first, last): tile = row block * panels + panel */
} GemmJob;

static inline __attribute__((always_inline)) void gemm_tile(const uint16_t *x, int64_t lda, int64_t rows,
                                                             const uint16_t *panel, int64_t pairs, uint16_t *out,
                                                             int64_t ldc, int64_t cols) {
    __m512 acc[GEMM_ROWS][2];
    for (int r = 0; r < GEMM_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; kk++) {
        const __m512bh lo = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * GEMM_COLS);
        const __m512bh hi = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * GEMM_COLS + GEMM_COLS);
        for (int r = 0; r < GEMM_ROWS; r++)
            if (r < rows) {
                int32_t pair;
                memcpy(&pair, x + r * lda + 2 * kk, sizeof pair);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, lo);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, hi);
            }
    }
    for (int r = 0; r < rows; r++) {
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(acc[r][0]), hi = (__m256i)_mm512_cvtneps_pbh(acc[r][1]);
        if (cols == GEMM_COLS) {
            _mm256_storeu_si256((__m256i *)(out + r * ldc), lo);
            _mm256_storeu_si256((__m256i *)(out + r * ldc + 16), hi);
        } else { /* the last panel of an N that is not a multiple of 32 */
            uint16_t row[GEMM_COLS];
            _mm256_storeu_si256((__m256i *)row, lo);
            _mm256_storeu_si256((__m256i *)(row + 16), hi);
            memcpy(out + r * ldc, row, (size_t)cols * sizeof(uint16_t));
        }
    }
}

static void *run_gemm(void *arg) {
    const GemmJob *job = (const GemmJob *)arg;
    const int64_t panels = (job->N + GEMM_COLS - 1) / GEMM_COLS, pairs = job->K / 2;
    /* Row blocks outer, panels inner: each block's rows stay in L1 and its outputs are written
       row by row; the panels (the whole weight) stay in L2. */
    int64_t m = job->first / panels * GEMM_ROWS, p = job->first % panels;
    for (int64_t t = job->first; t < job->last; t++) {
        const int64_t rows = job->M - m < GEMM_ROWS ? job->M - m : GEMM_ROWS;
        const int64_t cols = job->N - p * GEMM_COLS < GEMM_COLS ? job->N - p * GEMM_COLS : GEMM_COLS;
        const uint16_t *x = job->x + m * job->lda, *panel = job->packed + p * pairs * 2 * GEMM_COLS;
        uint16_t *out = job->out + m * job->N + p * GEMM_COLS;
        if (rows == GEMM_ROWS) /* a constant row count: the k loop without per-row tests */
            gemm_tile(x, job->lda, GEMM_ROWS, panel, pairs, out, job->N, cols);
        else
            gemm_tile(x, job->lda, rows, panel, pairs, out, job->N, cols);
        if (++p == panels) {
            p = 0;
            m += GEMM_ROWS;
        }
    }
    return NULL;
}


int rz_bf16_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed, int64_t N, uint16_t *out,
                 int threads) {
    if (K % 2) return 4;
    int64_t tiles;
    threads = gemm_threads(M, K, N, threads, &tiles);
    GemmJob jobs[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (GemmJob){x, packed, out, M, K, N, lda, tiles * i / threads, tiles * (i + 1) / threads};
    return run_parallel(run_gemm, jobs, sizeof(GemmJob), threads);
}

int rz_bf16_gemm_built(void) { return 1; }
#else
/* Built without AVX-512 BF16 (another CPU, or the portable build): rzero never routes a linear
   here (bf16_kernel() asks rz_bf16_gemm_built first); a call anyway gets status 3. */
int rz_bf16_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed, int64_t N, uint16_t *out,
                 int threads) {
    (void)x; (void)M; (void)K; (void)lda; (void)packed; (void)N; (void)out; (void)threads;
    return 3;
}

int rz_bf16_gemm_built(void) { return 0; }
#endif

/* ---------------------------------------------------------------------------------------------
   An fp32 GEMM with the bits of this machine's torch.mm on fp32 (N, K) weights at the shapes where
   cpu_layer.py's probe proves them (rzero/ops/cpu_layer.py, f32_kblock): each output one sum on one
   thread, K cut into blocks of `kblock` from k = 0 (the last one shorter), each block a chain of
   fused multiply-adds from zero in k order, the blocks' sums added in order. MKL's sgemm sums so
   here (one block up to K = 192, two halves up to 384, blocks of 192 beyond); a probe, not this
   comment, decides where it is used. Weight packed in panels of 32 columns, k-major. */
int rz_f32_pack(const float *w, int64_t N, int64_t K, float *out) {
    const int64_t panels = (N + GEMM_COLS - 1) / GEMM_COLS;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < GEMM_COLS; j++) {
                const int64_t n = p * GEMM_COLS + j;
                out[(p * K + k) * GEMM_COLS + j] = n < N ? w[n * K + k] : 0.0f;
            }
    return 0;
}

typedef struct {
    const float *x, *packed;
    float *out;
    int64_t M, K, N, lda, kblock, first, last; /* tiles [first, last), as GemmJob's */
} F32GemmJob;

static inline __attribute__((always_inline)) void f32_tile(const float *x, int64_t lda, int64_t rows,
                                                            const float *panel, int64_t K, int64_t kblock, float *out,
                                                            int64_t ldc, int64_t cols) {
#if defined(__AVX512F__)
    __m512 total[GEMM_ROWS][2], acc[GEMM_ROWS][2];
    for (int64_t k0 = 0; k0 < K; k0 += kblock) {
        const int64_t end = k0 + kblock < K ? k0 + kblock : K;
        for (int r = 0; r < GEMM_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t k = k0; k < end; k++) {
            const __m512 lo = _mm512_loadu_ps(panel + k * GEMM_COLS), hi = _mm512_loadu_ps(panel + k * GEMM_COLS + 16);
            for (int r = 0; r < GEMM_ROWS; r++)
                if (r < rows) {
                    const __m512 a = _mm512_set1_ps(x[r * lda + k]);
                    acc[r][0] = _mm512_fmadd_ps(a, lo, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(a, hi, acc[r][1]);
                }
        }
        for (int r = 0; r < GEMM_ROWS; r++) {
            total[r][0] = k0 == 0 ? acc[r][0] : _mm512_add_ps(total[r][0], acc[r][0]);
            total[r][1] = k0 == 0 ? acc[r][1] : _mm512_add_ps(total[r][1], acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float row[GEMM_COLS];
        _mm512_storeu_ps(row, total[r][0]);
        _mm512_storeu_ps(row + 16, total[r][1]);
        memcpy(out + r * ldc, row, (size_t)cols * sizeof(float));
    }
#else
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) {
            float total = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += kblock) {
                const int64_t end = k0 + kblock < K ? k0 + kblock : K;
                float acc = 0.0f;
                for (int64_t k = k0; k < end; k++) acc = fmaf(x[r * lda + k], panel[k * GEMM_COLS + j], acc);
                total = k0 == 0 ? acc : total + acc;
            }
            out[r * ldc + j] = total;
        }
#endif
}

static void *run_f32_gemm(void *arg) {
    const F32GemmJob *job = (const F32GemmJob *)arg;
    const int64_t panels = (job->N + GEMM_COLS - 1) / GEMM_COLS;
    int64_t m = job->first / panels * GEMM_ROWS, p = job->first % panels;
    for (int64_t t = job->first; t < job->last; t++) {
        const int64_t rows = job->M - m < GEMM_ROWS ? job->M - m : GEMM_ROWS;
        const int64_t cols = job->N - p * GEMM_COLS < GEMM_COLS ? job->N - p * GEMM_COLS : GEMM_COLS;
        const float *x = job->x + m * job->lda, *panel = job->packed + p * job->K * GEMM_COLS;
        float *out = job->out + m * job->N + p * GEMM_COLS;
        if (rows == GEMM_ROWS)
            f32_tile(x, job->lda, GEMM_ROWS, panel, job->K, job->kblock, out, job->N, cols);
        else
            f32_tile(x, job->lda, rows, panel, job->K, job->kblock, out, job->N, cols);
        if (++p == panels) {
            p = 0;
            m += GEMM_ROWS;
        }
    }
    return NULL;
}

int rz_f32_gemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed, int64_t N, int64_t kblock,
                float *out, int threads) {
    if (kblock < 1) return 4;
    int64_t tiles;
    threads = gemm_threads(M, K, N, threads, &tiles);
    F32GemmJob jobs[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (F32GemmJob){x, packed, out, M, K, N, lda, kblock, tiles * i / threads, tiles * (i + 1) / threads};
    return run_parallel(run_f32_gemm, jobs, sizeof(F32GemmJob), threads);
}

/* ---------------------------------------------------------------------------------------------
   A dense decoder layer in one call (rzero/ops/cpu_layer.py), for the engine's steps, where the
   layer's ops one by one cost more in Python around them than in their kernels (tiny models). The
   same kernels as those ops, on the same rows in the same order, so the same bits; the
   elementwise ops between them are torch's CPU ops written out with their bits:

     x = norm(h); q, k, v = x Wqkv; a = cached_attention(q, k, v); h2 = h + a Wo;
     gate, up = norm(h2) Wgu; out = h2 + (silu(gate) * up) Wdown

   bf16 models: the linears on rz_bf16_gemm; torch computes a bf16 add or multiply in fp32 and
   rounds to bf16 (nearest even; a NaN becomes 0xffff in its vectorised conversion, the one every
   element of these sizes takes). fp32 models: the linears on rz_f32_gemm with the K blocks that
   give torch.mm's bits (cpu_layer.py proves them per weight shape). silu is x / (1 + exp(-x)) in
   fp32 with the expf of torch's vector code (torch_exp below). cpu_layer.py checks the elementwise
   ops against torch once per process before using them. Every row of the padded batch is
   computed, as the ops do. */
enum { LD_TOKENS, LD_PADDED, LD_HIDDEN, LD_HEADS, LD_KV_HEADS, LD_HEAD_DIM, LD_BLOCK, LD_TABLE_STRIDE, LD_QKV_N,
       LD_INTERMEDIATE, LD_BF16, LD_KBLOCK_QKV, LD_KBLOCK_O, LD_KBLOCK_GATE_UP, LD_KBLOCK_DOWN, LD_COUNT };
enum { LP_H, LP_INPUT_NORM, LP_QKV, LP_Q_NORM, LP_K_NORM, LP_COS, LP_SIN, LP_SLOTS, LP_K_CACHE, LP_V_CACHE, LP_TABLES,
       LP_SEQ, LP_POS, LP_O, LP_POST_NORM, LP_GATE_UP, LP_DOWN, LP_OUT, LP_SCRATCH, LP_COUNT };

/* fp32 -> bf16 as torch's vectorised conversion: nearest even, every NaN 0xffff. */
static inline uint16_t torch_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float power_of_two(int32_t q) {
    const uint32_t bits = (uint32_t)(q + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* expf as torch's CPU vector code computes it (SLEEF's expf_u10): q = round(d / ln2); s = d - q ln2
   (ln2 in two parts); a degree-5 polynomial in s; times 2^q in two halves; 0 below -104 and
   infinity above 100. The clamp only keeps the integer conversion defined where the result is
   replaced anyway. */
#define EXP_LOG2E 1.442695040888963407359924681001892137426645954152985934135449406931f
#define EXP_LN2_HI -0.693145751953125f
#define EXP_LN2_LO -1.428606765330187045e-06f
#define EXP_C5 0.000198527617612853646278381f
#define EXP_C4 0.00139304355252534151077271f
#define EXP_C3 0.00833336077630519866943359f
#define EXP_C2 0.0416664853692054748535156f
#define EXP_C1 0.166666671633720397949219f
#define EXP_C0 0.5f
static inline float torch_exp(float d) {
    const float c = fmaxf(fminf(d, 100.0f), -104.0f);
    const int32_t q = (int32_t)nearbyintf(c * EXP_LOG2E);
    float s = fmaf((float)q, EXP_LN2_HI, c);
    s = fmaf((float)q, EXP_LN2_LO, s);
    float u = EXP_C5;
    u = fmaf(u, s, EXP_C4);
    u = fmaf(u, s, EXP_C3);
    u = fmaf(u, s, EXP_C2);
    u = fmaf(u, s, EXP_C1);
    u = fmaf(u, s, EXP_C0);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * power_of_two(q >> 1) * power_of_two(q - (q >> 1));
    if (d < -104.0f) u = 0.0f;
    if (d > 100.0f) u = INFINITY;
    return d != d ? d : u;
}

static inline float torch_silu(float x) { return x / (1.0f + torch_exp(-x)); }

#if defined(__AVX512F__)
/* torch_silu of sixteen lanes, the same operations. */
static inline __m512 torch_silu16(__m512 x) {
    const __m512 d = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
    const __m512 c = _mm512_max_ps(_mm512_min_ps(d, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-104.0f));
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(EXP_LOG2E)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(EXP_LN2_HI), c);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(EXP_LN2_LO), s);
    __m512 u = _mm512_set1_ps(EXP_C5);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(EXP_C4));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(EXP_C3));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(EXP_C2));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(EXP_C1));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(EXP_C0));
    const __m512 one = _mm512_set1_ps(1.0f);
    u = _mm512_add_ps(one, _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1), bias = _mm512_set1_epi32(127);
    u = _mm512_mul_ps(_mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23))),
                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, half), bias), 23)));
    u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u, _mm512_setzero_ps());
    u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(100.0f), _CMP_GT_OQ), u, _mm512_set1_ps(INFINITY));
    u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), u, d);
    return _mm512_div_ps(x, _mm512_add_ps(one, u));
}

/* torch_bf16 of sixteen lanes, in the low halves of the 32-bit lanes. */
static inline __m512i torch_bf16_16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0xffff));
}

static inline __m512 widened16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* act[r, i] = silu(gate[r, i]) * up[r, i] for gate, up the halves of each gu row (rows x 2I), in
   the model's dtype: bf16 rounds silu's result to bf16 before the multiply, as torch does. */
static void silu_mul(int bf16, const void *gu, int64_t rows, int64_t I, void *act) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
        if (bf16) {
            const uint16_t *gate = (const uint16_t *)gu + r * 2 * I, *up = gate + I;
            uint16_t *out = (uint16_t *)act + r * I;
#if defined(__AVX512F__)
            for (; i + 16 <= I; i += 16) {
                const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(torch_bf16_16(torch_silu16(widened16(gate + i))), 16));
                _mm256_storeu_si256((__m256i *)(out + i),
                                    _mm512_cvtepi32_epi16(torch_bf16_16(_mm512_mul_ps(silu, widened16(up + i)))));
            }
#endif
            for (; i < I; i++)
                out[i] = torch_bf16(bf16_value(torch_bf16(torch_silu(bf16_value(gate[i])))) * bf16_value(up[i]));
        } else {
            const float *gate = (const float *)gu + r * 2 * I, *up = gate + I;
            float *out = (float *)act + r * I;
#if defined(__AVX512F__)
            for (; i + 16 <= I; i += 16)
                _mm512_storeu_ps(out + i, _mm512_mul_ps(torch_silu16(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
#endif
            for (; i < I; i++) out[i] = torch_silu(gate[i]) * up[i];
        }
    }
}

/* out[i] = a[i] + b[i] for n elements in the model's dtype (out may be b). */
static void add_rows(int bf16, const void *a, const void *b, void *out, int64_t n) {
    if (bf16) {
        const uint16_t *a16 = a, *b16 = b;
        uint16_t *o16 = out;
        for (int64_t i = 0; i < n; i++) o16[i] = torch_bf16(bf16_value(a16[i]) + bf16_value(b16[i]));
    } else {
        const float *a32 = a, *b32 = b;
        float *o32 = out;
        for (int64_t i = 0; i < n; i++) o32[i] = a32[i] + b32[i];
    }
}

static int layer_gemm(int bf16, const void *x, int64_t M, int64_t K, const void *packed, int64_t N, int64_t kblock,
                      void *out, int threads) {
    return bf16 ? rz_bf16_gemm(x, M, K, K, packed, N, out, threads) : rz_f32_gemm(x, M, K, K, packed, N, kblock, out, threads);
}

/* scratch: padded * (3 * hidden + qkv_n + 2 * H * D + 3 * intermediate) elements of the dtype. */
int rz_decoder_layer(const int64_t *dims, void *const *ptrs, float eps, float scale, int threads) {
    const int64_t T = dims[LD_PADDED], hidden = dims[LD_HIDDEN], H = dims[LD_HEADS], Hkv = dims[LD_KV_HEADS];
    const int64_t D = dims[LD_HEAD_DIM], qkv_n = dims[LD_QKV_N], I = dims[LD_INTERMEDIATE];
    const int bf16 = (int)dims[LD_BF16];
    const int64_t size = bf16 ? 2 : 4;
    char *x = ptrs[LP_SCRATCH], *qkv = x + T * hidden * size, *q_rot = qkv + T * qkv_n * size;
    char *attn = q_rot + T * H * D * size, *h2 = attn + T * H * D * size, *gu = h2 + T * hidden * size;
    char *act = gu + T * 2 * I * size, *out = ptrs[LP_OUT];
    int status = rz_rms_norm(ptrs[LP_H], bf16, 1, T, 0, hidden, hidden, ptrs[LP_INPUT_NORM], eps, x, threads);
    if (!status) status = layer_gemm(bf16, x, T, hidden, ptrs[LP_QKV], qkv_n, dims[LD_KBLOCK_QKV], qkv, threads);
    if (!status)
        status = rz_cached_attention(qkv, qkv + H * D * size, qkv + (H + Hkv) * D * size, qkv_n, qkv_n, qkv_n, bf16,
                                     ptrs[LP_Q_NORM], ptrs[LP_K_NORM], eps, ptrs[LP_COS], ptrs[LP_SIN], ptrs[LP_SLOTS],
                                     ptrs[LP_K_CACHE], ptrs[LP_V_CACHE], q_rot, ptrs[LP_TABLES], dims[LD_TABLE_STRIDE],
                                     ptrs[LP_SEQ], ptrs[LP_POS], dims[LD_TOKENS], T, H, Hkv, D, dims[LD_BLOCK], scale,
                                     attn, threads);
    if (!status) status = layer_gemm(bf16, attn, T, H * D, ptrs[LP_O], hidden, dims[LD_KBLOCK_O], h2, threads);
    if (status) return status;
    add_rows(bf16, ptrs[LP_H], h2, h2, T * hidden);
    status = rz_rms_norm(h2, bf16, 1, T, 0, hidden, hidden, ptrs[LP_POST_NORM], eps, x, threads);
    if (!status) status = layer_gemm(bf16, x, T, hidden, ptrs[LP_GATE_UP], 2 * I, dims[LD_KBLOCK_GATE_UP], gu, threads);
    if (status) return status;
    silu_mul(bf16, gu, T, I, act);
    status = layer_gemm(bf16, act, T, I, ptrs[LP_DOWN], hidden, dims[LD_KBLOCK_DOWN], out, threads);
    if (!status) add_rows(bf16, h2, out, out, T * hidden);
    return status;
}

/* An engine step's whole backbone in one call (rzero/ops/cpu_stack.py): the token embeddings, every
   decoder layer (rz_decoder_layer, each with its own LD_ / LP_ arrays), the final RMSNorm. The same
   kernels on the same rows as the model's forward with one rz_decoder_layer call per layer, and
   the steps between them written out: the embedding and the rotary rows are copies (a bf16 model's
   rows of fp32 tables rounded as torch's .to(bfloat16) rounds them), so the bits are those
   of that forward. The step's entries of each layer's arrays are written here; the caller sets
   the layer's own (weights, caches, sizes). Returns 5 if a token id is outside the embedding. */
enum { SD_TOKENS, SD_PADDED, SD_TABLE_STRIDE, SD_LAYERS, SD_HIDDEN, SD_HEAD_DIM, SD_VOCAB, SD_BF16, SD_ROPE_FP32,
       SD_EMBED_ROW_STRIDE, SD_EMBED_COL_STRIDE, SD_COUNT };
enum { SP_IDS, SP_POSITIONS, SP_EMBED, SP_ROPE_COS, SP_ROPE_SIN, SP_SLOTS, SP_TABLES, SP_SEQ, SP_POS, SP_NORM, SP_OUT,
       SP_SCRATCH, SP_COUNT };

/* scratch: 2 * padded * (hidden + head_dim) elements of the dtype, then each layer's scratch. */
int rz_decoder_stack(const int64_t *dims, void *const *ptrs, int64_t *const *layer_dims, void **const *layer_ptrs,
                     const float *eps, float norm_eps, float scale, int threads) {
    const int64_t T = dims[SD_PADDED], hidden = dims[SD_HIDDEN], D = dims[SD_HEAD_DIM], vocab = dims[SD_VOCAB];
    const int bf16 = (int)dims[SD_BF16];
    const int64_t size = bf16 ? 2 : 4;
    const int64_t *ids = ptrs[SP_IDS], *positions = ptrs[SP_POSITIONS];
    char *h[2], *cos, *sin, *work;
    h[0] = ptrs[SP_SCRATCH];
    h[1] = h[0] + T * hidden * size;
    cos = h[1] + T * hidden * size;
    sin = cos + T * D * size;
    work = sin + T * D * size;
    for (int64_t r = 0; r < T; r++) {
        if (ids[r] < 0 || ids[r] >= vocab) return 5;
        /* the embedding's row: a bf16 model's is a column of its LM head's (K, N) layout (pack_weights) */
        const int64_t row = ids[r] * dims[SD_EMBED_ROW_STRIDE], col = dims[SD_EMBED_COL_STRIDE];
        if (col == 1) {
            memcpy(h[0] + r * hidden * size, (const char *)ptrs[SP_EMBED] + row * size, (size_t)(hidden * size));
        } else if (bf16) {
            const uint16_t *src = (const uint16_t *)ptrs[SP_EMBED] + row;
            for (int64_t d = 0; d < hidden; d++) ((uint16_t *)h[0])[r * hidden + d] = src[d * col];
        } else {
            const float *src = (const float *)ptrs[SP_EMBED] + row;
            for (int64_t d = 0; d < hidden; d++) ((float *)h[0])[r * hidden + d] = src[d * col];
        }
        if (bf16 && dims[SD_ROPE_FP32]) { /* a bf16 model's rows of fp32 tables */
            const float *c = (const float *)ptrs[SP_ROPE_COS] + positions[r] * D;
            const float *s = (const float *)ptrs[SP_ROPE_SIN] + positions[r] * D;
            uint16_t *c16 = (uint16_t *)cos + r * D, *s16 = (uint16_t *)sin + r * D;
            for (int64_t d = 0; d < D; d++) {
                c16[d] = torch_bf16(c[d]);
                s16[d] = torch_bf16(s[d]);
            }
        } else { /* tables in the model's dtype */
            memcpy(cos + r * D * size, (const char *)ptrs[SP_ROPE_COS] + positions[r] * D * size, (size_t)(D * size));
            memcpy(sin + r * D * size, (const char *)ptrs[SP_ROPE_SIN] + positions[r] * D * size, (size_t)(D * size));
        }
    }
    int status = 0;
    for (int64_t i = 0; i < dims[SD_LAYERS] && !status; i++) {
        int64_t *ld = layer_dims[i];
        void **lp = layer_ptrs[i];
        ld[LD_TOKENS] = dims[SD_TOKENS];
        ld[LD_PADDED] = T;
        ld[LD_TABLE_STRIDE] = dims[SD_TABLE_STRIDE];
        lp[LP_H] = h[i % 2];
        lp[LP_OUT] = h[(i + 1) % 2];
        lp[LP_COS] = cos;
        lp[LP_SIN] = sin;
        lp[LP_SLOTS] = ptrs[SP_SLOTS];
        lp[LP_TABLES] = ptrs[SP_TABLES];
        lp[LP_SEQ] = ptrs[SP_SEQ];
        lp[LP_POS] = ptrs[SP_POS];
        lp[LP_SCRATCH] = work;
        status = rz_decoder_layer(ld, lp, eps[i], scale, threads);
    }
    if (!status)
        status = rz_rms_norm(h[dims[SD_LAYERS] % 2], bf16, 1, T, 0, hidden, hidden, ptrs[SP_NORM], norm_eps, ptrs[SP_OUT],
                             threads);
    return status;
}

/* Up to `steps` decode steps of a batch of sequences in one call (rzero/ops/cpu_stack.py,
   decode_steps): each step runs the backbone (rz_decoder_stack) on one token of each sequence still
   running, at the position after its last, the LM head (the invariant linear's own GEMM: layer_gemm),
   the sampling transform of a temperature (the logits widened to fp32 and divided by it, as torch
   divides, or left alone at 1), rz_log_softmax and rz_inverse_cdf at the row's uniform for that
   step; the token drawn is the row's next input. A row stops after drawing one of its stop ids or
   its limit of tokens, and the later steps run without it, as the engine's batches one step at a
   time do. The rows go in chunks of `chunk`, each through all of its steps before the next: no
   row's bits depend on the other rows of its step (batch invariance), so the chunks give the bits
   of the whole batch's steps, and a chunk's K/V rows stay in the caches from one step to the next
   (docs/benchmarks.md, twentieth session). The stack's step entries (SD_TOKENS, SD_PADDED, the
   ids, positions, slots, sequences and output) are written here; the caller sets SD_TABLE_STRIDE,
   SP_TABLES and SP_SCRATCH (for `rows` rows, padded). Rows are padded to a multiple of the row tile
   with token 0 at the first row's position, as AttentionMeta pads. */
enum { DD_STEPS, DD_ROWS, DD_ROW_TILE, DD_VOCAB, DD_BLOCK, DD_KBLOCK, DD_CHUNK, DD_COUNT };
enum { DP_IDS, DP_CONTEXT, DP_LIMIT, DP_STOPS, DP_STOP_START, DP_TEMPERATURE, DP_UNIFORM, DP_LM_HEAD, DP_TOKENS,
       DP_LOGPROBS, DP_COUNTS, DP_COUNT };

typedef struct {
    int64_t *ids, *positions, *slots, *seq, *drawn, *live; /* padded rows each (live: the chunk's) */
    char *hidden, *logits;
    float *x, *lp, *u, *prefixes;
} DecodeWork;

/* Rows [first, last) through their steps. */
static int chunk_steps(int64_t *dims, void **ptrs, int64_t *const *layer_dims, void **const *layer_ptrs,
                       const float *eps, float norm_eps, float scale, int threads, const int64_t *steps_dims,
                       void *const *steps_ptrs, int64_t first, int64_t last, const DecodeWork *w) {
    const int64_t steps = steps_dims[DD_STEPS], B = steps_dims[DD_ROWS], tile = steps_dims[DD_ROW_TILE];
    const int64_t V = steps_dims[DD_VOCAB], block = steps_dims[DD_BLOCK], stride = dims[SD_TABLE_STRIDE];
    const int64_t hidden = dims[SD_HIDDEN];
    const int bf16 = (int)dims[SD_BF16];
    const int64_t *ids_in = steps_ptrs[DP_IDS], *context = steps_ptrs[DP_CONTEXT], *limit = steps_ptrs[DP_LIMIT];
    const int64_t *stops = steps_ptrs[DP_STOPS], *stop_start = steps_ptrs[DP_STOP_START], *tables = ptrs[SP_TABLES];
    const float *temperature = steps_ptrs[DP_TEMPERATURE], *uniform = steps_ptrs[DP_UNIFORM];
    int64_t *tokens = steps_ptrs[DP_TOKENS], *counts = steps_ptrs[DP_COUNTS], *live = w->live;
    float *logprobs = steps_ptrs[DP_LOGPROBS];
    int status = 0;
    int64_t n = 0; /* rows still running, in order */
    for (int64_t b = first; b < last; b++)
        if (limit[b] > 0) live[n++] = b;
    for (int64_t k = 0; k < steps && n > 0 && !status; k++) {
        const int64_t padded = (n + tile - 1) / tile * tile;
        for (int64_t i = 0; i < padded; i++) {
            const int64_t b = live[i < n ? i : 0];
            w->positions[i] = context[b] + k;
            w->ids[i] = i >= n ? 0 : k ? tokens[(k - 1) * B + b] : ids_in[b];
            w->slots[i] = tables[b * stride + w->positions[i] / block] * block + w->positions[i] % block; /* padding: unread */
            w->seq[i] = b;
        }
        dims[SD_TOKENS] = n;
        dims[SD_PADDED] = padded;
        ptrs[SP_IDS] = w->ids;
        ptrs[SP_POSITIONS] = ptrs[SP_POS] = w->positions;
        ptrs[SP_SLOTS] = w->slots;
        ptrs[SP_SEQ] = w->seq;
        ptrs[SP_OUT] = w->hidden;
        status = rz_decoder_stack(dims, ptrs, layer_dims, layer_ptrs, eps, norm_eps, scale, threads);
        if (!status)
            status = layer_gemm(bf16, w->hidden, n, hidden, steps_ptrs[DP_LM_HEAD], V, steps_dims[DD_KBLOCK], w->logits,
                                threads);
        if (status) break;
        for (int64_t i = 0; i < n; i++) {
            const float t = temperature[live[i]];
            float *row = w->x + i * V;
            for (int64_t v = 0; v < V; v++)
                row[v] = bf16 ? bf16_value(((const uint16_t *)w->logits)[i * V + v]) : ((const float *)w->logits)[i * V + v];
            if (t != 1.0f)
                for (int64_t v = 0; v < V; v++) row[v] = row[v] / t;
            w->u[i] = uniform[k * B + live[i]];
        }
        status = rz_log_softmax(w->x, n, V, V, w->lp, threads);
        if (!status) status = rz_inverse_cdf(w->lp, n, V, w->u, w->prefixes, w->drawn, threads);
        int64_t kept = 0;
        for (int64_t i = 0; i < n && !status; i++) {
            const int64_t b = live[i], token = w->drawn[i];
            tokens[k * B + b] = token;
            logprobs[k * B + b] = w->lp[i * V + token];
            int ends = ++counts[b] == limit[b];
            for (int64_t j = stop_start[b]; j < stop_start[b + 1] && !ends; j++) ends = stops[j] == token;
            if (!ends) live[kept++] = b;
        }
        n = kept;
    }
    return status;
}

int rz_decode_steps(int64_t *dims, void **ptrs, int64_t *const *layer_dims, void **const *layer_ptrs, const float *eps,
                    float norm_eps, float scale, int threads, const int64_t *steps_dims, void *const *steps_ptrs) {
    const int64_t B = steps_dims[DD_ROWS], tile = steps_dims[DD_ROW_TILE], V = steps_dims[DD_VOCAB];
    const int64_t chunk = steps_dims[DD_CHUNK] > 0 && steps_dims[DD_CHUNK] < B ? steps_dims[DD_CHUNK] : B;
    const int64_t P = (chunk + tile - 1) / tile * tile, size = dims[SD_BF16] ? 2 : 4;
    int64_t *counts = steps_ptrs[DP_COUNTS];
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(6 * P));
    char *bytes = malloc((size_t)(P * (dims[SD_HIDDEN] + V) * size));
    float *floats = malloc(sizeof(float) * (size_t)(2 * P * V + P + (threads > 0 ? threads : 1) * 4 * V));
    int status = index && bytes && floats ? 0 : 1;
    const DecodeWork w = {index, index + P, index + 2 * P, index + 3 * P, index + 4 * P, index + 5 * P,
                          bytes, bytes + P * dims[SD_HIDDEN] * size,
                          floats, floats + P * V, floats + 2 * P * V, floats + 2 * P * V + P};
    for (int64_t b = 0; b < B; b++) counts[b] = 0;
    for (int64_t first = 0; first < B && !status; first += chunk) /* each chunk through all of its steps */
        status = chunk_steps(dims, ptrs, layer_dims, layer_ptrs, eps, norm_eps, scale, threads, steps_dims, steps_ptrs,
                             first, first + chunk < B ? first + chunk : B, &w);
    free(index);
    free(bytes);
    free(floats);
    return status;
}

/* The elementwise parts alone, for cpu_layer.py's check against torch: act = silu_mul of the
   (rows, 2 I) gu rows, sum = a + b (n elements), in bf16 or fp32. */
void rz_layer_elementwise(int bf16, const void *gu, int64_t rows, int64_t I, void *act, const void *a, const void *b,
                          int64_t n, void *sum) {
    silu_mul(bf16, gu, rows, I, act);
    add_rows(bf16, a, b, sum, n);
}

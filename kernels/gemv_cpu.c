/* M activation rows times a weight matrix, y[m, n] = sum_k W[n, k] x[m, k], for a decode step (M = 1) or a
 * batch of them on an x86-64 CPU with AVX2, FMA and F16C; and a decode step's RMSNorm rows and attention.
 * Built and loaded by cpu_library.py (gemv_cpu.py, norm_cpu.py and attention_cpu.py document why); OpenMP
 * splits the GEMVs' weight rows and the attention's chunks of keys.
 *
 * Every product and sum is fp32 (the 4-bit VNNI loop's: exact integers, scaled once a group; the AVX512-BF16 and
 * AMX-BF16 loops': exact products of bf16, summed into fp32); each output is rounded once to the activations' dtype.
 * dtype codes: 0 = fp32, 1 = bf16, 2 = fp16; a quantized KV cache's keys and values also 3 = int8, 4 = E4M3
 * (read as 2^-8 times their value: e4m3x8). Each entry point but the norm (which allocates nothing) returns
 * 0, or 1 when it could not allocate its fp32 scratch (a row's copy, a head's scores).
 */
#include <cpuid.h>
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/syscall.h>  /* arch_prctl: the AMX tiles' permission (bf16_amx_on_cpu) */
#include <unistd.h>
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; a NaN stays a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float load_one(const void *x, int dtype, int64_t k) {
    if (dtype == 1) return bf16_to_f32(((const uint16_t *)x)[k]);
    if (dtype == 2) return _cvtsh_ss(((const uint16_t *)x)[k]);
    return ((const float *)x)[k];
}

static void store_one(void *y, int dtype, int64_t n, float v) {
    if (dtype == 1) ((uint16_t *)y)[n] = f32_to_bf16(v);
    else if (dtype == 2) ((uint16_t *)y)[n] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    else ((float *)y)[n] = v;
}

/* output (m, n) of a GEMV (y: [M, N] of dtype): its fp32 sum plus bias n (b: [N] of dtype, or NULL), rounded
 * once to dtype */
static inline void store_out(void *y, const void *b, int dtype, int64_t m, int64_t N, int64_t n, float v) {
    store_one(y, dtype, m * N + n, b ? v + load_one(b, dtype, n) : v);
}

/* Each loop over a row's codes also asks for the bytes AHEAD past the ones it reads. A decode step reads a
 * weight from memory once, and the hardware prefetchers stop at each 4 KiB page, so without this a thread
 * waits at every page for its first lines and their address translation (measured in docs/results.md, "Figures
 * formerly in code comments"). A prefetch past a weight's end is harmless: it never faults. */
#define AHEAD 4096
#define PREFETCH(p) _mm_prefetch((const char *)(p) + AHEAD, _MM_HINT_T0)

static inline float rounded(float v, int dtype) { /* v rounded to dtype and back (fp32: v) */
    if (dtype == 1) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == 2) return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

/* 8 fp32 values to out[i..i+8) of dtype, each rounded once to nearest even, as PyTorch's casts round them (a
 * bf16 NaN keeps its sign and quiet bit; only a NaN payload held in the low 16 bits alone would not survive,
 * and arithmetic on finite codes and scales makes none) */
static inline void store8(void *out, int dtype, int64_t i, __m256 v) {
    if (dtype == 0) {
        _mm256_storeu_ps((float *)out + i, v);
    } else if (dtype == 2) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
    }
}

/* RMSNorm of M rows of D: r = 1 / sqrt(sum(x^2) / D + eps) in fp32, then, as qinfer.kernels.norm.rms_norm_ref
 * orders and rounds it: scale_in_fp32 (Gemma) y = (x r) (offset + w), rounded once to x's dtype; else (Llama)
 * y = w * (x r rounded to x's dtype), the product rounded to it. x and y: [M, D] of dtype; w: [D] of wdtype.
 * Where D is a multiple of 8 the squares are summed in 8 lanes, then across them.
 * A decode step's norms are a few rows of a few hundred, and PyTorch's dozen ops for them cost far more than
 * the arithmetic: one thread; many rows (an engine step's decode rows of many sequences) split over the threads,
 * each row's arithmetic the same either way. */
static inline __m256 load8(const void *p, int dtype, int64_t i);

void qinfer_rms_norm(const void *x, const void *w, void *y, int64_t M, int64_t D, float eps, float offset,
                     int dtype, int wdtype, int scale_in_fp32) {
    #pragma omp parallel for schedule(static) if (M * D >= 16384)
    for (int64_t m = 0; m < M; m++) {
        float ss = 0.f;
        int64_t d0 = 0;
        if (D % 8 == 0) {  /* 8 lanes of squares, then their sum */
            __m256 acc = _mm256_setzero_ps();
            for (; d0 < D; d0 += 8) {
                __m256 v = load8(x, dtype, m * D + d0);
                acc = _mm256_fmadd_ps(v, v, acc);
            }
            ss = hsum(acc);
        }
        for (int64_t d = d0; d < D; d++) {
            float v = load_one(x, dtype, m * D + d);
            ss += v * v;
        }
        float r = 1.f / sqrtf(ss / (float)D + eps);
        int64_t d = 0;
        if (scale_in_fp32 && D % 8 == 0)  /* (x r) (offset + w) 8 at a time, each rounded once as it is stored */
            for (; d < D; d += 8) {
                float out[8];
                __m256 v = _mm256_mul_ps(load8(x, dtype, m * D + d), _mm256_set1_ps(r));
                _mm256_storeu_ps(out, _mm256_mul_ps(v, _mm256_add_ps(_mm256_set1_ps(offset), load8(w, wdtype, d))));
                for (int i = 0; i < 8; i++) store_one(y, dtype, m * D + d + i, out[i]);
            }
        for (; d < D; d++) {
            float v = load_one(x, dtype, m * D + d) * r, g = load_one(w, wdtype, d);
            store_one(y, dtype, m * D + d, scale_in_fp32 ? v * (offset + g) : rounded(v, dtype) * g);
        }
    }
}

/* a weight as the kernels read it: bf16 (w, ld = elements between rows), integer (w = codes, scale, zero or
 * NULL, group, bits) or FP8 (w = codes, scale, group = the number of scales); set once per weight by
 * gemv_cpu.py */
typedef struct {
    const void *w, *scale, *zero;
    int64_t N, K, ld, group, bits;
    const uint8_t *tiles;  /* 4-bit codes in int4_tiles.py's layout (NULL: none built), and their scales and */
    const float *tile_sz;  /* zero points, for the AVX512-VNNI loop over 16 output rows at a time */
} qinfer_weight;

static inline __m256 bf16x8(const uint16_t *p) { /* 8 bf16 -> fp32: the bits move up by 16 */
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 E4M3 codes -> fp32, each 2^-8 times its value: sign-extended to 16 bits and shifted up by 7, the code's
 * exponent and mantissa sit in an fp16's (exponent bias 15 against E4M3's 7; subnormals too), its sign in
 * the fp16's sign; the AND drops the sign extension's copy at bit 14. */
static inline __m256 e4m3x8(const uint8_t *p) {
    __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16((short)0xBF80)));
}

/* 16 E4M3 codes -> their fp16 bits (as e4m3x8), in one register */
static inline __m256i e4m3x16(const uint8_t *p) {
    __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16((short)0xBF80));
}

static inline __m256 load8(const void *p, int dtype, int64_t i) { /* 8 elements of dtype from p[i] as fp32 */
    if (dtype == 1) return bf16x8((const uint16_t *)p + i);
    if (dtype == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dtype == 3)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    if (dtype == 4) return e4m3x8((const uint8_t *)p + i);
    return _mm256_loadu_ps((const float *)p + i);
}

static inline size_t esize(int dtype) { return dtype == 0 ? 4 : dtype <= 2 ? 2 : 1; }

/* e^x for 8 lanes of x <= 0 (scores less their max), as Cephes' expf computes it: x = n ln2 + r with |r| <=
 * ln2 / 2, e^r by a degree-6 polynomial (within 1.3 ulp of e^x), times 2^n through the exponent bits. Below
 * -87.3 (e^x < 2^-126: nothing a softmax's sum sees) it gives e^-87.3; a NaN stays a NaN. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  /* the second operand is kept when it is NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Where row j of one KV head lives: a cache slice's rows ``stride`` elements apart from ``base``, or a paged
 * cache's (``table`` not NULL): row j is row j % P of block table[j / P], blocks ``block_stride`` elements apart
 * from ``base`` (the head's rows in block 0), rows ``stride`` apart inside a block; P = 1 << shift. */
typedef struct {
    const char *base;
    int64_t stride, block_stride;
    const int64_t *table;
    int shift;
} rows_t;

static inline __attribute__((always_inline)) const char *row_at(const rows_t *r, int64_t j, size_t esz) {
    if (!r->table) return r->base + j * r->stride * esz;
    return r->base + (r->table[j >> r->shift] * r->block_stride + (j & ((1 << r->shift) - 1)) * r->stride) * esz;
}

/* Scores of M (1-4: a constant where inlined) query heads qf [M, D] against keys j0..j1 of one KV head: sc[i *
 * n + j - j0] = (qf_i . k_j) * scale (* key j's position scale, where kp is not NULL), top[i] their max. Each
 * key row is loaded and widened once for the M heads, whose sums stay in registers. */
static inline __attribute__((always_inline)) void scores_of(
        const rows_t *kr_, const rows_t *vr_, int dtype, const float *qf, int64_t D, int64_t j0, int64_t j1,
        float *sc, int64_t n, float scale, const rows_t *kp, const int M, float *top) {
    const size_t esz = esize(dtype);
    for (int i = 0; i < M; i++) top[i] = -INFINITY;
    const int64_t ahead = AHEAD / (D * esz) > 1 ? AHEAD / (D * esz) : 1;  /* rows, AHEAD bytes of a cache's rows */
    for (int64_t j = j0; j < j1; j++) {
        const char *kr = row_at(kr_, j, esz);
        if (j + ahead < j1) {
            const char *next = row_at(kr_, j + ahead, esz);
            for (int64_t o = 0; o < D * (int64_t)esz; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        if (vr_) {  /* value row j on its way to L2 while the keys stream: weighted_sum reads it in columns */
            const char *vr = row_at(vr_, j, esz);
            for (int64_t o = 0; o < D * (int64_t)esz; o += 64) _mm_prefetch(vr + o, _MM_HINT_T1);
        }
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kv = load8(kr, dtype, d);
            for (int i = 0; i < M; i++) a[i] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qf + i * D + d), a[i]);
        }
        const float sj = kp ? scale * *(const float *)row_at(kp, j, sizeof(float)) : scale;
        for (int i = 0; i < M; i++) {
            float x = hsum(a[i]) * sj;
            sc[i * n + j - j0] = x;
            if (x > top[i]) top[i] = x;
        }
    }
}

/* acc[i] = sum_j p[i * n + j] v_(j0 + j) for M (1-4) heads over values j0..j0+n of one KV head, 16 columns at a
 * time: the M x 16 sums stay in registers across the keys, each value row's 16 columns widened once. */
static inline __attribute__((always_inline)) void weighted_sum(
        const rows_t *vr_, int dtype, const float *p, int64_t n, int64_t j0, int64_t D, float *acc, const int M) {
    const size_t esz = esize(dtype);
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo[4], hi[4];
        for (int i = 0; i < M; i++) lo[i] = _mm256_setzero_ps(), hi[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const char *vr = row_at(vr_, j0 + j, esz);
            __m256 v0 = load8(vr, dtype, d), v1 = load8(vr, dtype, d + 8);
            for (int i = 0; i < M; i++) {
                __m256 pj = _mm256_broadcast_ss(p + i * n + j);
                lo[i] = _mm256_fmadd_ps(pj, v0, lo[i]), hi[i] = _mm256_fmadd_ps(pj, v1, hi[i]);
            }
        }
        for (int i = 0; i < M; i++) _mm256_storeu_ps(acc + i * D + d, lo[i]), _mm256_storeu_ps(acc + i * D + d + 8, hi[i]);
    }
    for (; d < D; d += 8) {  /* D % 16 == 8 */
        __m256 lo[4];
        for (int i = 0; i < M; i++) lo[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            __m256 v0 = load8(row_at(vr_, j0 + j, esz), dtype, d);
            for (int i = 0; i < M; i++) lo[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * n + j), v0, lo[i]);
        }
        for (int i = 0; i < M; i++) _mm256_storeu_ps(acc + i * D + d, lo[i]);
    }
}

/* One query row's attention over S cached positions, as qinfer.kernels.attention's decode step computes it:
 * per query head h (its KV head g = h / (H / Hkv)), scores s_j = (q . k_j) * scale in fp32, p = softmax(s),
 * out = sum_j p_j v_j, rounded once to dtype. q: [B, H] rows of D at q + b * qb + h * qh; k, v: [B, Hkv] heads
 * of S rows of D at k + b * kb + g * kh + j * ks (strides in elements: a KV cache's slice), of kv_dtype. D % 8
 * == 0. A quantized cache's scales, one per KV head and channel (k_scale, v_scale: fp32 [Hkv, D], or NULL for 1),
 * are not applied to each key and value: (q . (k_j * k_scale[g])) = ((q * k_scale[g]) . k_j), so the queries
 * are scaled once, and v_scale[g] multiplies the head's sums once (for E4M3 codes, each times the 2^8 e4m3x8
 * leaves out). Scales per position and KV head (k_pos, v_pos: fp32 [B, Hkv] rows of S at b * pb + g * ph, or
 * NULL) multiply key j's score and value j's softmax weight (after the weights' sum is taken).
 *
 * Split over the keys (as flash-decoding does): OpenMP takes (batch, KV head, chunk of keys) tasks; a task
 * reads each key and value row of its chunk once for all the query heads that share it, and keeps per head
 * its chunk's max score m_c, sum of exp(s - m_c) and sum of exp(s - m_c) v. The chunks then combine exactly:
 * out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) sum_c, M the largest m_c. Returns 1 when out of memory.
 * A task's scores (scores_of) stream its keys, prefetching AHEAD bytes on (a cache's 4 KiB pages stop the
 * hardware prefetchers, as a weight's do) and sending each value row to L2; the exponentials take 8 lanes at
 * a time (exp8); the weighted sum of values (weighted_sum) then reads the rows from L2 in 16-column blocks,
 * its sums in registers. Both loops run in one parallel region. */
/* The int8 codes' integer loops (defined below, where the compiler's VNNI support is known): whether they are
 * on, and the scores and weighted sums of a task's G query heads through them. */
static int attention_i8_vnni(void);
static void scores_i8(const rows_t *kr, const rows_t *vr, const float *qf, int64_t G, int64_t D, int64_t j0,
                      int64_t j1, float *sc, int64_t n, float scale, const rows_t *kp, float *top);
static void weighted_i8(const rows_t *vr, const float *p, int64_t n, int64_t j0, int64_t D, float *acc, int64_t G);
static void weighted_i8_int(const rows_t *vr, const float *p, int64_t n, int64_t j0, int64_t D, float *acc,
                            int64_t G);

/* How many chunks of keys a sequence of S positions is split into: one per 1024 positions, at least one per
 * thread (at most S). */
static int64_t key_chunks(int64_t S) {
    int64_t chunks = (S + 1023) / 1024;
    if (chunks < omp_get_max_threads()) chunks = S < omp_get_max_threads() ? S : omp_get_max_threads();
    return chunks;
}

static int attention_rows(const void *q, const void *k, const void *v, void *out, int64_t B, int64_t H,
                          int64_t Hkv, int64_t S, int64_t D, int64_t qb, int64_t qh, int64_t kb, int64_t kh,
                          int64_t ks, int64_t vb, int64_t vh, int64_t vs, float scale, int dtype, int kv_dtype,
                          const float *k_scale, const float *v_scale, const float *k_pos, const float *v_pos,
                          int64_t pb, int64_t ph, const int64_t *table, int64_t tb, int64_t P,
                          const int64_t *starts, const int64_t *ends) {
    const int64_t G = H / Hkv, per_task = G * (D + 2);  /* a task's partials: per head acc[D], max, sum */
    int shift_p = 0;
    while (table && ((int64_t)1 << shift_p) < P) shift_p++;
    const size_t esz = esize(dtype), kvsz = esize(kv_dtype);
    /* every sequence's keys split by its own range alone (key_chunks), so its sums do not depend on the others';
     * chunks is the most any sequence has, the rest of a shorter one's chunks empty (weight 0 in the combine) */
    const int64_t chunks = key_chunks(S), tasks = B * Hkv * chunks;
    float *part = malloc(sizeof(float) * tasks * per_task);
    if (!part) return 1;
    int failed = 0;
    #pragma omp parallel
    {
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t b = t / (Hkv * chunks), g = t / chunks % Hkv;
        const int64_t lo = table ? starts[b] : 0, hi = table ? ends[b] : S;  /* this sequence's keys */
        const int64_t own = key_chunks(hi - lo), len = (hi - lo + own - 1) / own;
        int64_t j0 = t % chunks < own ? lo + t % chunks * len : hi, j1 = j0 + len < hi ? j0 + len : hi;
        if (j0 > hi) j0 = hi;
        float *acc = part + t * per_task, *top = acc + G * D, *total = top + G;
        float *buf = malloc(sizeof(float) * (G * D + G * (j1 > j0 ? j1 - j0 : 1)));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = buf, *sc = buf + G * D;  /* the group's queries in fp32; scores [G, n] */
        const int64_t n = j1 > j0 ? j1 - j0 : 0;
        const float *kg = k_scale ? k_scale + g * D : NULL, *vg = v_scale ? v_scale + g * D : NULL;
        rows_t kr, vr, kpr, vpr;  /* keys, values and their position scales, contiguous or through the table */
        if (table) {
            const int64_t *bt = table + b * tb;
            kr = (rows_t){(const char *)k + g * P * D * kvsz, D, Hkv * P * D, bt, shift_p};
            vr = (rows_t){(const char *)v + g * P * D * kvsz, D, Hkv * P * D, bt, shift_p};
            kpr = (rows_t){(const char *)(k_pos ? k_pos + g * P : NULL), 1, Hkv * P, bt, shift_p};
            vpr = (rows_t){(const char *)(v_pos ? v_pos + g * P : NULL), 1, Hkv * P, bt, shift_p};
        } else {
            kr = (rows_t){(const char *)k + (b * kb + g * kh) * kvsz, ks, 0, NULL, 0};
            vr = (rows_t){(const char *)v + (b * vb + g * vh) * kvsz, vs, 0, NULL, 0};
            kpr = (rows_t){(const char *)(k_pos ? k_pos + b * pb + g * ph : NULL), 1, 0, NULL, 0};
            vpr = (rows_t){(const char *)(v_pos ? v_pos + b * pb + g * ph : NULL), 1, 0, NULL, 0};
        }
        const rows_t *kp = k_pos ? &kpr : NULL, *vp = v_pos ? &vpr : NULL;
        for (int64_t i = 0; i < G; i++) {
            const char *qrow = (const char *)q + (b * qb + (g * G + i) * qh) * esz;
            for (int64_t d = 0; d < D; d++) qf[i * D + d] = load_one(qrow, dtype, d) * (kg ? kg[d] : 1.f);
        }
        const float shift = kv_dtype == 4 ? 256.f : 1.f;  /* e4m3x8 reads 2^-8 times each code's value */
        const float s = kg ? scale * shift : scale;
        const int i8 = kv_dtype == 3 && dtype != 0 && D % 32 == 0 && D <= 512 ? attention_i8_vnni() : 0;
        if (i8) scores_i8(&kr, &vr, qf, G, D, j0, j1, sc, n, s, kp, top);
        for (int64_t i0 = 0; i0 < G && !i8; i0 += 4) {  /* up to 4 heads at a time, their sums in registers */
            const int m = G - i0 < 4 ? (int)(G - i0) : 4;
            const rows_t *vpre = i0 ? NULL : &vr;  /* the first heads' pass sends the value rows to L2 */
            const float *qi = qf + i0 * D;
            float *si = sc + i0 * n;
            switch (m) {
                case 4: scores_of(&kr, vpre, kv_dtype, qi, D, j0, j1, si, n, s, kp, 4, top + i0); break;
                case 3: scores_of(&kr, vpre, kv_dtype, qi, D, j0, j1, si, n, s, kp, 3, top + i0); break;
                case 2: scores_of(&kr, vpre, kv_dtype, qi, D, j0, j1, si, n, s, kp, 2, top + i0); break;
                default: scores_of(&kr, vpre, kv_dtype, qi, D, j0, j1, si, n, s, kp, 1, top + i0);
            }
        }
        for (int64_t i = 0; i < G; i++) {
            float *si = sc + i * n;
            const __m256 mi = _mm256_set1_ps(top[i]);
            __m256 t8 = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + j), mi));
                _mm256_storeu_ps(si + j, e);
                t8 = _mm256_add_ps(t8, e);
            }
            float t = hsum(t8);
            for (; j < n; j++) t += (si[j] = expf(si[j] - top[i]));
            total[i] = t;
            if (vp)  /* value j's scale joins its weight after the sum: the softmax's denominator is the keys' */
                for (j = 0; j < n; j++) si[j] *= *(const float *)row_at(vp, j0 + j, sizeof(float));
        }
        if (i8 == 2) weighted_i8_int(&vr, sc, n, j0, D, acc, G);
        else if (i8) weighted_i8(&vr, sc, n, j0, D, acc, G);
        for (int64_t i0 = 0; i0 < G && !i8; i0 += 4) {
            const int m = G - i0 < 4 ? (int)(G - i0) : 4;
            switch (m) {
                case 4: weighted_sum(&vr, kv_dtype, sc + i0 * n, n, j0, D, acc + i0 * D, 4); break;
                case 3: weighted_sum(&vr, kv_dtype, sc + i0 * n, n, j0, D, acc + i0 * D, 3); break;
                case 2: weighted_sum(&vr, kv_dtype, sc + i0 * n, n, j0, D, acc + i0 * D, 2); break;
                default: weighted_sum(&vr, kv_dtype, sc + i0 * n, n, j0, D, acc + i0 * D, 1);
            }
        }
        if (vg)
            for (int64_t i = 0; i < G; i++)
                for (int64_t d = 0; d < D; d++) acc[i * D + d] *= vg[d] * shift;
        free(buf);
    }  /* the for's barrier: every task's partials are in */
    int fail;
    #pragma omp atomic read
    fail = failed;
    if (!fail) {
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            int64_t b = bh / H, h = bh % H, g = h / G, i = h % G;
            const float *p0 = part + (b * Hkv + g) * chunks * per_task;  /* this head's chunks, per_task apart */
            float M = -INFINITY, total = 0.f;
            for (int64_t c = 0; c < chunks; c++)
                if (p0[c * per_task + G * D + i] > M) M = p0[c * per_task + G * D + i];
            float weight[chunks];  /* e^(m_c - M); an empty chunk's max is -inf: weight 0 */
            for (int64_t c = 0; c < chunks; c++) {
                float m = p0[c * per_task + G * D + i];
                weight[c] = m == -INFINITY ? 0.f : expf(m - M);
                total += weight[c] * p0[c * per_task + G * D + G + i];
            }
            char *orow = (char *)out + bh * D * esz;
            for (int64_t d = 0; d < D; d++) {
                float o = 0.f;
                for (int64_t c = 0; c < chunks; c++) o += weight[c] * p0[c * per_task + i * D + d];
                store_one(orow, dtype, d, o / total);
            }
        }
    }
    }  /* one parallel region for both loops: one wake of the threads */
    free(part);
    return failed;
}

int qinfer_decode_attention(const void *q, const void *k, const void *v, void *out, int64_t B, int64_t H,
                            int64_t Hkv, int64_t S, int64_t D, int64_t qb, int64_t qh, int64_t kb, int64_t kh,
                            int64_t ks, int64_t vb, int64_t vh, int64_t vs, float scale, int dtype, int kv_dtype,
                            const float *k_scale, const float *v_scale, const float *k_pos, const float *v_pos,
                            int64_t pb, int64_t ph) {
    return attention_rows(q, k, v, out, B, H, Hkv, S, D, qb, qh, kb, kh, ks, vb, vh, vs, scale, dtype, kv_dtype,
                          k_scale, v_scale, k_pos, v_pos, pb, ph, NULL, 0, 0, NULL, NULL);
}

/* The same over a paged cache (qinfer.format, "The paged KV cache"): k, v: [N, Hkv, P, D] pools of kv_dtype
 * (P a power of two), k_pos, v_pos: [N, Hkv, P] fp32 or NULL; sequence b's keys starts[b]..ends[b]-1 through its
 * block table, table + b * tb ([B, tb] int64). Each sequence's keys are split as above by its own range: its sums
 * are the same whatever other sequences share the call, and those of qinfer_decode_attention over the same keys. */
int qinfer_paged_decode_attention(const void *q, const void *k, const void *v, void *out, int64_t B, int64_t H,
                                  int64_t Hkv, int64_t D, int64_t qb, int64_t qh, float scale, int dtype,
                                  int kv_dtype, const float *k_scale, const float *v_scale, const float *k_pos,
                                  const float *v_pos, const int64_t *table, int64_t tb, int64_t P,
                                  const int64_t *starts, const int64_t *ends) {
    int64_t S = 0;
    for (int64_t b = 0; b < B; b++)
        if (ends[b] - starts[b] > S) S = ends[b] - starts[b];
    return attention_rows(q, k, v, out, B, H, Hkv, S, D, qb, qh, 0, 0, 0, 0, 0, 0, scale, dtype, kv_dtype,
                          k_scale, v_scale, k_pos, v_pos, 0, 0, table, tb, P, starts, ends);
}

/* The GEMVs: x [M, K], y [M, N] and b [N] (or NULL: no bias) of dtype, for M rows at once (a batch of decode
 * steps). Each weight row is read from memory once for all M: its columns, a tile at a time, are widened to fp32
 * (the 4-bit VNNI loop: unpacked to bytes) into a thread's scratch, and every row of x is summed against the tile
 * there, in L1. Each row of x is prepared (an fp32 copy, group sums, the VNNI loop's fixed point) once per call.
 * A row's sums take the same products in the same order whatever M is and whichever rows share the call, so
 * its output has the bits it has alone: a batch's outputs do not depend on its other rows, and M = 1 is the
 * one-row GEMV. */

/* x [M, K] of dtype in fp32, row after row; NULL when out of memory */
static float *rows_f32(const void *x, int dtype, int64_t M, int64_t K) {
    float *xf = malloc(sizeof(float) * (M * K > 0 ? M * K : 1));
    if (xf)
        for (int64_t i = 0; i < M * K; i++) xf[i] = load_one(x, dtype, i);
    return xf;
}

#define TILE 1024  /* columns of a weight row a dense GEMV widens at a time: 4 KiB of fp32, read from L1 */

/* Columns k0..k1 of weight row n, bf16 (rows ld elements apart) or E4M3 (fp8: rows ld bytes apart, each code
 * 2^-8 times its value: e4m3x8), widened to fp32 in w. k0 is a multiple of 32, k1 - k0 of 8. */
static void widen_tile(const qinfer_weight *wt, int64_t n, int64_t k0, int64_t k1, float *w, int fp8) {
    const uint16_t *h = (const uint16_t *)wt->w + n * wt->ld;
    const uint8_t *c = (const uint8_t *)wt->w + n * wt->ld;
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
        if (fp8) {
            PREFETCH(c + k);
            for (int j = 0; j < 32; j += 16) {  /* 16 codes a widening: fewer instructions than e4m3x8 twice */
                __m256i p = e4m3x16(c + k + j);
                _mm256_storeu_ps(w + k - k0 + j, _mm256_cvtph_ps(_mm256_castsi256_si128(p)));
                _mm256_storeu_ps(w + k - k0 + j + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1)));
            }
        } else {
            PREFETCH(h + k);
            for (int j = 0; j < 32; j += 8) _mm256_storeu_ps(w + k - k0 + j, bf16x8(h + k + j));
        }
    }
    for (; k < k1; k += 8) _mm256_storeu_ps(w + k - k0, fp8 ? e4m3x8(c + k) : bf16x8(h + k));
}

/* A weight row's columns k0..k1 (widened to fp32 in w) against each of the M rows of x (xf: [M, K]): each row's
 * four sums over 32 columns at a time (acc: [M][4][8], carried from tile to tile), then 8 at a time into the
 * first (only the last tile ends off a multiple of 32). Four independent sums: the FMA latency, not the loads,
 * would bound one. */
static void dense_tile(const float *w, const float *xf, int64_t M, int64_t K, int64_t k0, int64_t k1, float *acc) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = xf + m * K;
        float *a = acc + m * 32;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16);
        __m256 a3 = _mm256_loadu_ps(a + 24);
        int64_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k - k0), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k - k0 + 8), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k - k0 + 16), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k - k0 + 24), _mm256_loadu_ps(x + k + 24), a3);
        }
        for (; k < k1; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k - k0), _mm256_loadu_ps(x + k), a0);
        _mm256_storeu_ps(a, a0), _mm256_storeu_ps(a + 8, a1), _mm256_storeu_ps(a + 16, a2);
        _mm256_storeu_ps(a + 24, a3);
    }
}

/* y = x W^T (+ b) for a bf16 (fp8 = 0) or E4M3 (fp8 = 1: K % 8 == 0) weight [N, K]: per output row, the
 * tiles of its weight row widened once and summed against every row of x (widen_tile, dense_tile); bf16
 * columns past the last multiple of 8 one at a time; an E4M3 row's sum times 2^8 and its scale (one per row,
 * group == N, or one in all). */
static int dense_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M, int dtype,
                      int fp8) {
    const int64_t N = wt->N, K = wt->K, k8 = K / 8 * 8;
    float *xf = rows_f32(x, dtype, M, K);
    if (!xf) return 1;
    int failed = 0;
    #pragma omp parallel
    {
        float *w = malloc(sizeof(float) * (TILE + 32 * M));  /* a tile of the weight row, then the rows' sums */
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!w) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float *acc = w + TILE;
            memset(acc, 0, sizeof(float) * 32 * M);
            for (int64_t k0 = 0; k0 < k8; k0 += TILE) {
                const int64_t k1 = k0 + TILE < k8 ? k0 + TILE : k8;
                widen_tile(wt, n, k0, k1, w, fp8);
                dense_tile(w, xf, M, K, k0, k1, acc);
            }
            for (int64_t m = 0; m < M; m++) {
                const float *a = acc + m * 32;
                float s = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)),
                                             _mm256_add_ps(_mm256_loadu_ps(a + 16), _mm256_loadu_ps(a + 24))));
                if (fp8) s = s * 256.f * ((const float *)wt->scale)[wt->group == N ? n : 0];
                for (int64_t k = k8; k < K; k++)
                    s += bf16_to_f32(((const uint16_t *)wt->w)[n * wt->ld + k]) * xf[m * K + k];
                store_out(y, b, dtype, m, N, n, s);
            }
        }
        free(w);
    }
    free(xf);
    return failed;
}

/* bf16 rows against a bf16 weight by VDPBF16PS (AVX512-BF16): each instruction multiplies 32 pairs of bf16 (exact
 * in fp32) and adds each lane's two products to its fp32 sum, rounding once per lane (to nearest even; denormal
 * inputs and results read and written as zero). A block of BF16_BLOCK output rows (their weight rows, 8 x 2 K
 * bytes, stay in L1) meets up to 3 rows of x a pass: 24 accumulators, one per (row of x, output row), each a
 * single chain over the columns, 32 at a time in column order, the last part of 32 masked to zeros (any K). Each
 * weight vector is loaded once for the pass's rows, each x vector once for the 8 outputs. At the end of a pass
 * the 8 accumulators of a row of x become one vector of its 8 sums (sums8), by the same tree of adds in every
 * lane. An output's arithmetic depends only on its row of x, its weight row and K: the same whatever M is and
 * whichever rows share its pass, so M = 1 is this loop too (bf16_dot_gemv orders the passes and prefetches). */
#if defined(__clang__) ? __clang_major__ >= 11 : __GNUC__ >= 10  /* compilers that know AVX512-BF16 */
#define QINFER_BF16_DOT 1
#define BF16_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"
#define BF16_BLOCK 8

/* lane i: the sum of a[i]'s 16 lanes, ((a0 + a8) + (a1 + a9)) + ((a2 + a10) + (a3 + a11)) plus the same over 4-7
 * and 12-15, whichever i */
static inline __attribute__((always_inline, target(BF16_TARGET))) __m256 sums8(const __m512 *a) {
    __m256 h[8];
    for (int i = 0; i < 8; i++) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* w: the block's 8 weight rows; x: R rows K apart; pf: npf rows to prefetch (row j at pf + j ld); out: the R
 * rows' 8 sums */
static inline __attribute__((always_inline, target(BF16_TARGET))) void bf16_pass_m(
        const uint16_t *const *w, const uint16_t *x, int64_t K, const uint16_t *pf, int npf, int64_t ld, float *out,
        const int R) {
    __m512 acc[3][BF16_BLOCK];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < BF16_BLOCK; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int j = 0; j < npf; j++) _mm_prefetch((const char *)(pf + j * ld + k), _MM_HINT_T1);
        __m512bh xv[3];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
        for (int j = 0; j < BF16_BLOCK; j++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w[j] + k));
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[r]);
        }
    }
    if (k < K) {
        const __mmask32 part = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[3];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(part, x + r * K + k);
        for (int j = 0; j < BF16_BLOCK; j++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(part, w[j] + k);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, sums8(acc[r]));
}

static inline __attribute__((always_inline, target(BF16_TARGET))) void bf16_pass(const uint16_t *const *w, const uint16_t *x, int64_t K,
                                                          const uint16_t *pf, int npf, int64_t ld, float *out, int R) {
    switch (R) {  /* the loop built for each count of rows */
        case 3: bf16_pass_m(w, x, K, pf, npf, ld, out, 3); break;
        case 2: bf16_pass_m(w, x, K, pf, npf, ld, out, 2); break;
        default: bf16_pass_m(w, x, K, pf, npf, ld, out, 1);
    }
}

/* y = x W^T (+ b), x: bf16 [M, K], W: bf16 [N, K] rows ld apart. The threads split groups of BF16_GROUP blocks
 * (32 weight rows, 40 KiB at K = 640: held in L2 while they serve every row of x); within a group, BF16_CHUNK rows
 * of x at a time (15 KiB at K = 640) meet each block in turn, so that chunk and the block (10 KiB) are read from
 * L1 by the chunk's passes, where 64 rows of x (80 KiB) would push the block out of it. The passes over a block
 * prefetch the same block of the next group into L2 (the hardware prefetchers stop at each 4 KiB page), its 8 rows
 * shared out over the passes so that no pass asks for many lines at once. */
#define BF16_GROUP 4
#define BF16_CHUNK 12
static __attribute__((target(BF16_TARGET))) int bf16_dot_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M) {
    const int64_t N = wt->N, K = wt->K, ld = wt->ld, rows = BF16_GROUP * BF16_BLOCK;
    const uint16_t *W = (const uint16_t *)wt->w, *xs = (const uint16_t *)x;
    const int64_t passes = M / BF16_CHUNK * ((BF16_CHUNK + 2) / 3) + (M % BF16_CHUNK + 2) / 3;  /* per block */
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < (N + rows - 1) / rows; g++) {
        for (int64_t c = 0, p = 0; c < M; c += BF16_CHUNK, p += (BF16_CHUNK + 2) / 3) {
            const int64_t c1 = c + BF16_CHUNK < M ? c + BF16_CHUNK : M;
            for (int64_t n0 = g * rows; n0 < (g + 1) * rows && n0 < N; n0 += BF16_BLOCK) {
                const uint16_t *w[BF16_BLOCK];
                for (int j = 0; j < BF16_BLOCK; j++)  /* rows past N: summed, never stored */
                    w[j] = W + (n0 + j < N ? n0 + j : N - 1) * ld;
                float out[3 * BF16_BLOCK];
                for (int64_t m = c, q = p; m < c1; m += 3, q++) {  /* q: the pass's number over this block */
                    const int R = c1 - m < 3 ? (int)(c1 - m) : 3;
                    const int64_t lo = (BF16_BLOCK * q + passes - 1) / passes;  /* its rows of the next group */
                    const int64_t hi = (BF16_BLOCK * (q + 1) + passes - 1) / passes;
                    bf16_pass(w, xs + m * K, K, W + (n0 + rows + lo) * ld, (int)(hi - lo), ld, out, R);
                    for (int r = 0; r < R; r++) {
                        if (n0 + BF16_BLOCK <= N) {  /* the bias added in fp32, then one rounding, as store_out */
                            __m256 v = _mm256_loadu_ps(out + 8 * r);
                            if (b) v = _mm256_add_ps(v, bf16x8((const uint16_t *)b + n0));
                            store8(y, 1, (m + r) * N + n0, v);
                        } else {
                            for (int64_t j = 0; n0 + j < N; j++) store_out(y, b, 1, m + r, N, n0 + j, out[8 * r + j]);
                        }
                    }
                }
            }
        }
    }
    return 0;
}

static int bf16_dot_on_cpu(void) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
#define QINFER_BF16_DOT 0
static int bf16_dot_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M) {
    return 1;  /* never called: qinfer_bf16_dot says 0 */
}
static int bf16_dot_on_cpu(void) { return 0; }
#endif

/* bf16 rows against a bf16 weight by AMX (TDPBF16PS on tiles: 16 rows of 64 bytes each), computing the transpose
 * y^T = W x^T: a tile of 16 weight rows x 32 columns, loaded straight from the weight's own layout (rows ld apart: no
 * repacked copy, as gemma3's lm_head is also its embedding table), is the A operand; x, repacked once per call into
 * the B operand's layout (amx_pack), is B; each C tile holds 16 weight rows x 16 rows of x in fp32. TDPBF16PS adds
 * to each C element the 32 products of its weight row's and x row's 32 columns (each exact in fp32) in an order the
 * instruction fixes, rounding to nearest even whatever MXCSR says; denormal inputs read as zero, denormal sums
 * written as zero. A C element is zeroed, then summed over the column chunks in order, each from its own weight row
 * and x row alone: its arithmetic depends only on those two rows and K, not on M or on the rows of x beside it in
 * the tile, so a row's outputs are the bits it has alone, and M = 1 is this loop too (padded with zero rows of x:
 * the tiles' arithmetic is cheap beside reading the weight). A weight row's chunk past K, and rows past N, are read
 * through a zero-padded copy (amx_part), so no tile reads past the weight. The same products as the AVX512-BF16
 * loop's, summed in another order and rounding: the two loops' outputs differ within one bf16 rounding and an fp32
 * sum's error. The tiles need the OS's leave (arch_prctl, once per process: bf16_amx_on_cpu) and a configuration per
 * thread. */
#if QINFER_BF16_DOT && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define QINFER_BF16_AMX 1
#define AMX_TARGET BF16_TARGET ",amx-tile,amx-bf16"
#define AMX_STREAM_OUT (512 << 10)  /* bytes of y from which it is written around the caches (amx_store) */

/* LDTILECFG's 64 bytes: palette 1; tiles 0-3 (C), 4-5 (A: the weight) and 6-7 (B: x) of 16 rows x 64 bytes. Static
 * and constant: the intrinsic's asm names only the first 8 bytes as read, so bytes stored just before it might not
 * be written yet. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
static const tile_config AMX_CONFIG __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* _tile_loadd's asm names no memory: a tile loaded from a buffer the code just wrote needs this barrier between */
#define COMPILER_BARRIER() __asm__ volatile("" ::: "memory")

/* r[i] (16 rows of 16 32-bit elements) become their transpose, r[j] holding element j of every row: 32-bit, then
 * 64-bit interleaves within each 128-bit lane, then the four lanes of four registers exchanged */
static inline __attribute__((always_inline, target(AMX_TARGET))) void transpose16(__m512i *r) {
    __m512i s[16], u[16];
    for (int i = 0; i < 8; i++) {
        s[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        s[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u[4i + c], lane l: column 4l + c of rows 4i..4i+3 */
        u[4 * i] = _mm512_unpacklo_epi64(s[4 * i], s[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(s[4 * i], s[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(s[4 * i + 1], s[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(s[4 * i + 1], s[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88), r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* The lanes of a 32-column chunk from column k on (masked: none past K) */
static inline __mmask32 chunk_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
}

/* Block (c, kc) of x [M, K] as the B operand (xb: 512 bf16): row p holds columns 32 kc + 2p and 2p + 1 of x rows
 * 16 c..16 c + 15, a pair of bf16 (4 bytes) per row of x; zeros past M and past K. A row's chunk is 16 such pairs,
 * so the block is the transpose of the 16 rows' chunks as 32-bit elements. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_pack(const uint16_t *x, int64_t M, int64_t K,
                                                                             int64_t c, int64_t kc, uint16_t *xb) {
    const __mmask32 part = chunk_mask(K, 32 * kc);
    __m512i r[16];
    for (int i = 0; i < 16; i++)
        r[i] = 16 * c + i < M ? _mm512_maskz_loadu_epi16(part, x + (16 * c + i) * K + 32 * kc) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(xb + 32 * p), r[p]);
}

/* The chunk of 32 columns from k on of weight rows n0..n0+31 (W: rows ld apart), zeros past K and past N, into part
 * (32 rows of 32, 64 bytes apart): the A tiles of a group's last chunk, or of the last group, without reading past
 * the weight */
static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_part(const uint16_t *W, int64_t ld, int64_t N,
                                                                             int64_t K, int64_t n0, int64_t k,
                                                                             uint16_t *part) {
    const __mmask32 mask = chunk_mask(K, k);
    COMPILER_BARRIER();  /* after the tile loads of the chunk before */
    for (int r = 0; r < 32; r++)
        _mm512_store_si512((void *)(part + 32 * r), n0 + r < N ? _mm512_maskz_loadu_epi16(mask, W + (n0 + r) * ld + k)
                                                              : _mm512_setzero_si512());
    COMPILER_BARRIER();  /* before the tile loads of this one */
}

/* 16 fp32 sums, each plus its bias (b + n: 16 bf16, or NULL) in fp32, rounded once to bf16 to nearest even: the bits
 * store8 and store_out give */
static inline __attribute__((always_inline, target(AMX_TARGET))) __m256i bf16x16_out(__m512 v, const void *b,
                                                                                   int64_t n) {
    if (b) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + n));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
}

/* The columns of a C tile stored at c (fp32, 16 weight rows x 16 rows of x): r[i], the 16 outputs of row i of x, for
 * the first `rows` rows (a few: gathered one by one; else the tile transposed) */
static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_columns(const float *c, int64_t rows,
                                                                                __m512i *r) {
    if (rows < 4) {
        const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
        for (int64_t i = 0; i < rows; i++) r[i] = _mm512_castps_si512(_mm512_i32gather_ps(column, c + i, 4));
    } else {
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(c + 16 * i));
        transpose16(r);
    }
}

/* Two C tiles stored at c (fp32: weight rows n0.. and n0 + 16.., each by 16 rows of x m0..) into y [M, N]: each row
 * of x below M gets its 32 outputs (below N), the bias added in fp32, then one rounding, as store_out; one 64-byte
 * store a row where all 32 are in y. A large y (AMX_STREAM_OUT: the lm_head's) is written around the caches, whole
 * lines where aligned: it would not stay there under the weight's stream, and reading each line in before writing
 * it would take from that stream's bandwidth. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_store(const float *c, const void *b, void *y,
                                                                              int64_t M, int64_t N, int64_t m0,
                                                                              int64_t n0) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    const int stream = M * N * 2 >= AMX_STREAM_OUT;
    __m512i lo[16], hi[16];
    amx_columns(c, rows, lo);
    if (n0 + 16 < N) amx_columns(c + 256, rows, hi);
    uint16_t *out = (uint16_t *)y + m0 * N + n0;
    for (int64_t i = 0; i < rows; i++, out += N) {
        if (n0 + 32 <= N) {
            const __m256i a = bf16x16_out(_mm512_castsi512_ps(lo[i]), b, n0);
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), bf16x16_out(_mm512_castsi512_ps(hi[i]), b,
                                                                                         n0 + 16), 1);
            if (stream && ((uintptr_t)out & 63) == 0)
                _mm512_stream_si512((void *)out, v);
            else
                _mm512_storeu_si512((void *)out, v);
        } else {  /* the last group, in part: one at a time */
            float v[32];
            _mm512_storeu_ps(v, _mm512_castsi512_ps(lo[i]));
            if (n0 + 16 < N) _mm512_storeu_ps(v + 16, _mm512_castsi512_ps(hi[i]));
            for (int64_t j = 0; n0 + j < N; j++) store_out(y, b, 1, m0 + i, N, n0 + j, v[j]);
        }
    }
}

/* A pass's C tiles stored at c (tiles 0-1, and 2-3 where two), their outputs not yet in y: weight rows n0.. by rows
 * 16 c0.. of x. A thread stores a pass's outputs during the next pass's first chunk (amx_pass), so that their
 * arithmetic runs while that chunk's weight is on its way from memory. */
typedef struct {
    const float *c;  /* NULL: nothing pending */
    int64_t n0, c0;
    int two;
} amx_pending;

static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_flush(amx_pending *p, const void *b,
                                                                              void *y, int64_t M, int64_t N) {
    if (!p->c) return;
    amx_store(p->c, b, y, M, N, 16 * p->c0, p->n0);
    if (p->two) amx_store(p->c + 512, b, y, M, N, 16 * (p->c0 + 1), p->n0);
    p->c = NULL;
}

/* One pass over a group's 32 weight rows (n0..) against rows 16 c0 of x on, 16 (TWO = 0) or 32 (TWO = 1) of them: C
 * tiles 0-1 (weight rows n0.., n0 + 16.. by the first 16 rows of x) and 2-3 (by the next 16), summed over the K chunks
 * in order (A tiles 4-5, B tiles 6-7), stored into c and left pending (the pass before: stored into y after the first
 * chunk). The weight's tiles are loaded with TILELOADDT1, a hint that keeps them out of L1 (where x's blocks stay,
 * read by every group), and the first pass over a group prefetches the next group into L2, a part each chunk, in
 * address order: the hardware prefetchers follow the tiles' strided rows poorly and stop at each 4 KiB page. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void amx_pass(
        const uint16_t *W, int64_t ld, int64_t N, int64_t K, const uint16_t *xb, int64_t chunks, int64_t c0,
        int64_t n0, const void *b, void *y, int64_t M, uint16_t *part, float *c, amx_pending *pending, const int TWO) {
    const int whole = n0 + 32 <= N;
    const int64_t lines = (ld + chunks - 1) / chunks;  /* of the next group's 32 ld bf16 (ld lines), a chunk's part */
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kc = 0; kc < chunks; kc++) {
        const uint16_t *a = W + n0 * ld + 32 * kc;
        int64_t stride = 2 * ld;  /* bytes between a tile's rows */
        if (!whole || 32 * kc + 32 > K) {
            amx_part(W, ld, N, K, n0, 32 * kc, part);
            a = part, stride = 64;
        }
        if (c0 == 0) {
            const uint16_t *next = W + (n0 + 32) * ld + 32 * lines * kc;
            for (int64_t i = 0; i < lines; i++) _mm_prefetch((const char *)(next + 32 * i), _MM_HINT_T1);
        }
        _tile_loadd(6, xb + (c0 * chunks + kc) * 512, 64);
        _tile_stream_loadd(4, a, stride);
        _tile_stream_loadd(5, a + 8 * stride, stride);  /* 16 rows on: 16 stride bytes, 8 stride bf16 */
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (TWO) {
            _tile_loadd(7, xb + ((c0 + 1) * chunks + kc) * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (kc == 0) amx_flush(pending, b, y, M, N);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (TWO) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
    *pending = (amx_pending){c, n0, c0, TWO};
}

/* y = x W^T (+ b), x: bf16 [M, K], W: bf16 [N, K] rows ld apart. x is repacked (amx_pack) by the threads together;
 * then they split the groups of 32 weight rows, each group meeting the rows of x 32 at a time (a second pass over a
 * group, for M > 32, reads its rows again from the caches). */
static __attribute__((target(AMX_TARGET))) int bf16_amx_gemv(const qinfer_weight *wt, const void *x, const void *b,
                                                             void *y, int64_t M) {
    const int64_t N = wt->N, K = wt->K, ld = wt->ld, chunks = (K + 31) / 32, blocks = (M + 15) / 16;
    const uint16_t *W = (const uint16_t *)wt->w;
    uint16_t *xb = aligned_alloc(64, (size_t)(blocks * chunks) * 1024);
    if (!xb) return 1;
    #pragma omp parallel
    {
        uint16_t part[32 * 32] __attribute__((aligned(64)));
        float c[2][4 * 256] __attribute__((aligned(64)));  /* a pass's C tiles; the pass before's, pending */
        amx_pending pending = {NULL, 0, 0, 0};
        int p = 0;
        _tile_loadconfig(&AMX_CONFIG);  /* the tiles' shapes are each thread's own state */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks * chunks; i++)
            amx_pack((const uint16_t *)x, M, K, i / chunks, i % chunks, xb + 512 * i);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < (N + 31) / 32; g++)
            for (int64_t c0 = 0; c0 < blocks; c0 += 2, p ^= 1) {  /* the loop built for one block or two */
                if (c0 + 1 < blocks)
                    amx_pass(W, ld, N, K, xb, chunks, c0, g * 32, b, y, M, part, c[p], &pending, 1);
                else
                    amx_pass(W, ld, N, K, xb, chunks, c0, g * 32, b, y, M, part, c[p], &pending, 0);
            }
        amx_flush(&pending, b, y, M, N);
        _mm_sfence();  /* the streamed stores, in y before the threads join */
        _tile_release();
    }
    free(xb);
    return 0;
}

/* Whether the CPU has AMX-TILE (CPUID leaf 7: EDX bit 24) and the AMX extension at EDX bit `bit` (22: AMX-BF16, 25:
 * AMX-INT8), and Linux lets this process use the tiles' state: asked once (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA), for every thread of the process. The AMX-BF16 loop also needs the AVX512-BF16 loop's extensions
 * (its repacking and stores use them). */
static int amx_on_cpu(int bit) {
    static int granted = -1;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> bit & 1)) return 0;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
static int bf16_amx_on_cpu(void) { return bf16_dot_on_cpu() && amx_on_cpu(22); }
#else
#define QINFER_BF16_AMX 0
static int bf16_amx_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M) {
    return 1;  /* never called: qinfer_bf16_dot says no AMX */
}
static int amx_on_cpu(int bit) { return 0; }
static int bf16_amx_on_cpu(void) { return 0; }
#endif

/* Whether the CPU (and the compiler, and for AMX the OS) can run bf16 loop 1 (AVX512-BF16) or 2 (AMX-BF16) */
static int bf16_loop_on_cpu(int loop) { return loop == 1 ? bf16_dot_on_cpu() : loop == 2 ? bf16_amx_on_cpu() : 0; }

/* -1: not asked yet; then which loop bf16 rows take: 0 the fp32 one, 1 AVX512-BF16, 2 AMX-BF16 */
static int bf16_dot = -1;

/* Which loop bf16 rows against a bf16 weight take (at first AMX-BF16 where it runs here, else AVX512-BF16 where it
 * does, else the fp32 loop). loop = 0 takes the fp32 loop, 1 or 2 that loop where it runs here (else leaves the
 * setting), any other value only asks. Returns the setting before. */
int qinfer_bf16_dot(int loop) {
    if (bf16_dot < 0) bf16_dot = bf16_loop_on_cpu(2) ? 2 : bf16_loop_on_cpu(1) ? 1 : 0;
    int before = bf16_dot;
    if (loop == 0 || ((loop == 1 || loop == 2) && bf16_loop_on_cpu(loop))) bf16_dot = loop;
    return before;
}

/* W: bf16 [N, K], rows ld elements apart. bf16 rows take the AMX-BF16 or AVX512-BF16 loop where it is on
 * (qinfer_bf16_dot); fp32 and fp16 rows, and bf16 ones without either, the fp32 loop (dense_gemv). */
int qinfer_bf16_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M, int dtype) {
    const int loop = dtype == 1 ? qinfer_bf16_dot(-1) : 0;
    if (loop == 2) return bf16_amx_gemv(wt, x, b, y, M);
    if (loop == 1) return bf16_dot_gemv(wt, x, b, y, M);
    return dense_gemv(wt, x, b, y, M, dtype, 0);
}

/* codes: E4M3 [N, K], rows ld apart; scale: fp32, one per row (group == N) or one in all (group == 1); K % 8 == 0 */
int qinfer_fp8_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M, int dtype) {
    return dense_gemv(wt, x, b, y, M, dtype, 1);
}

/* The M rows of x as the integer GEMV reads them, made once per call (prepare_rows): xf, fp32 x [M, K], for
 * 4-bit codes each 16 entries' even ones, then their odd ones, the order a row's 8 bytes unpack in (low nibbles,
 * then high), so each nibble meets its own x without a shuffle; xs, the sums of x over each group [M, K/G]; for
 * the 4-bit VNNI loop, whether a row takes it (vnni [M]) and its x in fixed point per group (step, xh, xl). */
typedef struct {
    float *xf, *xs, *step;
    int8_t *xh, *xl;
    int *vnni;
} x_rows;

/* The 4-bit float loop's work with integer dot products (VPDPBUSD: four u8 x s8 products summed into each int32
 * lane), for CPUs that have them, as AVX-VNNI (VEX: Intel since Alder Lake and Sapphire Rapids) or AVX512-VNNI
 * with AVX512VL (EVEX on 256-bit registers: Intel since Cascade Lake, AMD since Zen 4): x in fixed point per
 * group, x[k] = step[g] * (256 h[k] + l[k]) with h and l signed bytes and |256 h + l| <= 16383 (so within
 * step / 2 = max|x in g| / 32766 of x, where bf16 keeps 2^-9 of x itself), and each group's codes summed against
 * h and against l as integers, exactly, then scaled once. Four codes' worth of multiply-adds an instruction
 * instead of the float loop's conversions to float. The zero-point term is the float loop's, on the exact x
 * sums. For weight row n, each group's codes are unpacked to bytes once (u: 32 low nibbles, then 32 high ones,
 * per 32 bytes) and summed against each row of x that takes this loop, into its acc and zacc (as
 * int_float_rows). 32 bytes (64 codes) a step: groups of 64 or more. The two loops are one body, built for each
 * instruction set. */
#define INT4_ROWS_VNNI(name, isa, dpbusd)                                                                          \
__attribute__((target(isa)))                                                                                       \
static void name(const qinfer_weight *wt, const x_rows *x, int64_t M, int64_t n, uint8_t *u, float *acc,          \
                 float *zacc) {                                                                                    \
    const __m256i low = _mm256_set1_epi8(0xF);                                                                     \
    const uint8_t *Z = wt->zero;                                                                                   \
    const uint16_t *S = wt->scale;                                                                                 \
    const int64_t K = wt->K, hb = wt->group / 2, ng = K / wt->group;                                               \
    const int64_t half = K / 2;  /* x's even entries first, then its odd ones: h[k] for even k at xh[k / 2] */     \
    const uint8_t *q = (const uint8_t *)wt->w + n * half;                                                          \
    for (int64_t g = 0; g < ng; g++) {                                                                             \
        for (int64_t i = 0; i < hb; i += 32) {                                                                     \
            PREFETCH(q + g * hb + i);                                                                              \
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + g * hb + i));                                     \
            _mm256_storeu_si256((__m256i *)(u + 2 * i), _mm256_and_si256(v, low));                                 \
            _mm256_storeu_si256((__m256i *)(u + 2 * i + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));      \
        }                                                                                                          \
        const int64_t sg = n * ng + g;                                                                             \
        const float s = _cvtsh_ss(S[sg]), z = Z ? (float)Z[sg] : 8.f;                                              \
        for (int64_t m = 0; m < M; m++) {                                                                          \
            if (!x->vnni[m]) continue;                                                                             \
            const int8_t *xh = x->xh + m * K + g * hb, *xl = x->xl + m * K + g * hb;                               \
            __m256i eh = _mm256_setzero_si256(), oh = eh, el = eh, ol = eh;                                        \
            for (int64_t i = 0; i < hb; i += 32) {                                                                 \
                __m256i e = _mm256_loadu_si256((const __m256i *)(u + 2 * i));                                      \
                __m256i o = _mm256_loadu_si256((const __m256i *)(u + 2 * i + 32));                                 \
                eh = dpbusd(eh, e, _mm256_loadu_si256((const __m256i *)(xh + i)));                                 \
                oh = dpbusd(oh, o, _mm256_loadu_si256((const __m256i *)(xh + half + i)));                          \
                el = dpbusd(el, e, _mm256_loadu_si256((const __m256i *)(xl + i)));                                 \
                ol = dpbusd(ol, o, _mm256_loadu_si256((const __m256i *)(xl + half + i)));                          \
            }                                                                                                      \
            __m256i t = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(eh, oh), 8), _mm256_add_epi32(el, ol));\
            __m256 a = _mm256_loadu_ps(acc + 8 * m);                                                               \
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(s * x->step[m * ng + g]), a);                \
            _mm256_storeu_ps(acc + 8 * m, a);                                                                      \
            zacc[m] += s * z * x->xs[m * ng + g];                                                                  \
        }                                                                                                          \
    }                                                                                                              \
}

typedef void (*int4_rows_vnni_fn)(const qinfer_weight *, const x_rows *, int64_t, int64_t, uint8_t *, float *,
                                  float *);
#if defined(__clang__) ? __clang_major__ >= 13 : __GNUC__ >= 11  /* compilers that know AVX-VNNI */
#define QINFER_VNNI 1
INT4_ROWS_VNNI(int4_rows_avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32)
INT4_ROWS_VNNI(int4_rows_avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", _mm256_dpbusd_epi32)
static const int4_rows_vnni_fn int4_rows_vnni[3] = {NULL, int4_rows_avxvnni, int4_rows_avx512vnni};
#else
#define QINFER_VNNI 0
static const int4_rows_vnni_fn int4_rows_vnni[3] = {NULL, NULL, NULL};  /* never called: qinfer_int4_vnni says 0 */
#endif

/* Whether the CPU has VPDPBUSD as AVX-VNNI (1) or as AVX512-VNNI (2), and the compiler knew them */
static int vnni_on_cpu(int loop) {
#if QINFER_VNNI
    if (loop == 1) return __builtin_cpu_supports("avxvnni") != 0;
    if (loop == 2) return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

/* -1: not asked yet; then which VNNI loop qinfer_int_gemv takes for 4-bit codes (0: none, the AVX2 float loop) */
static int int4_vnni = -1;

/* Which VNNI loop qinfer_int_gemv takes for 4-bit codes where a weight allows one: 0 none, 1 AVX-VNNI, 2
 * AVX512-VNNI (at first AVX512-VNNI where the CPU has it, whose loop over tiles takes M rows at once and is the
 * faster at one row too, else AVX-VNNI where it has that). loop = 0 turns them off, 1 or 2 takes that loop where
 * the CPU has it (else leaves the setting), any other value only asks. Returns the setting before. */
int qinfer_int4_vnni(int loop) {
    if (int4_vnni < 0) int4_vnni = vnni_on_cpu(2) ? 2 : vnni_on_cpu(1) ? 1 : 0;
    int before = int4_vnni;
    if (loop == 0 || ((loop == 1 || loop == 2) && vnni_on_cpu(loop))) int4_vnni = loop;
    return before;
}

/* The AVX512-VNNI loop over 16 output rows at a time (a tile, in int4_tiles.py's layouts). 4-bit codes: each 64-byte
 * vector holds 16 output rows x 8 columns of codes; its low nibbles (16 rows x 4 columns as bytes) and its high ones
 * (the next 4) meet a row of x's 4 entries broadcast, one VPDPBUSD each. 8-bit codes: each vector holds 16 output
 * rows x 4 columns of codes as bytes, one VPDPBUSD. Both against x's high and low fixed-point bytes (the same x as
 * INT4_ROWS_VNNI's, in column order: row m's high bytes at xc + 2 m K, its low ones K on). Each (row of x, output
 * row) keeps two int32 lanes over a group, exact; at the group's end its sum t = 256 sum q h + sum q l becomes
 * s (t step - z sum x) in fp32, added to the output's fp32 sum: no horizontal sums, and each output's arithmetic is
 * the same whatever rows share its block. R (1-8, a constant where inlined) rows of x a pass: the tile's codes,
 * loaded (and unpacked) once a vector, serve R rows from registers (8 rows: 24 accumulators of the 32 registers). */
#if QINFER_VNNI
#define TILE_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
static inline __attribute__((always_inline, target(TILE_TARGET))) void int_tile_m(
        const qinfer_weight *wt, const x_rows *x, const int *rows, const int8_t *xc, int64_t t, float *out,
        const int R, const int BITS) {
    const int64_t K = wt->K, G = wt->group, ng = K / G;
    const uint8_t *q = wt->tiles + t * 2 * BITS * K;  /* a tile: 16 rows of K codes */
    const float *sz = wt->tile_sz + t * ng * 32;
    const __m512i low = _mm512_set1_epi8(0xF);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i h[8], l[8];
        for (int r = 0; r < R; r++) h[r] = _mm512_setzero_si512(), l[r] = _mm512_setzero_si512();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32 / BITS) {
            const uint8_t *p = q + 2 * BITS * k;
            PREFETCH(p);
            __m512i v = _mm512_loadu_si512((const void *)p);
            if (BITS == 4) {
                __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *xh = xc + 2 * rows[r] * K + k, *xl = xh + K;
                    int32_t h0, h1, l0, l1;
                    memcpy(&h0, xh, 4), memcpy(&h1, xh + 4, 4), memcpy(&l0, xl, 4), memcpy(&l1, xl + 4, 4);
                    h[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(h[r], lo, _mm512_set1_epi32(h0)), hi,
                                               _mm512_set1_epi32(h1));
                    l[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(l[r], lo, _mm512_set1_epi32(l0)), hi,
                                               _mm512_set1_epi32(l1));
                }
            } else {
                for (int r = 0; r < R; r++) {
                    const int8_t *xh = xc + 2 * rows[r] * K + k, *xl = xh + K;
                    int32_t h0, l0;
                    memcpy(&h0, xh, 4), memcpy(&l0, xl, 4);
                    h[r] = _mm512_dpbusd_epi32(h[r], v, _mm512_set1_epi32(h0));
                    l[r] = _mm512_dpbusd_epi32(l[r], v, _mm512_set1_epi32(l0));
                }
            }
        }
        const __m512 s = _mm512_loadu_ps(sz + g * 32), z = _mm512_loadu_ps(sz + g * 32 + 16);
        for (int r = 0; r < R; r++) {
            const int64_t mg = rows[r] * ng + g;
            __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h[r], 8), l[r]);
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(x->step[mg]));
            f = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->xs[mg]), f);
            acc[r] = _mm512_fmadd_ps(f, s, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

/* the loop built for each count of rows and each width */
#define INT_TILE_ROWS(BITS)                                                                                        \
    switch (R) {                                                                                                   \
        case 8: int_tile_m(wt, x, rows, xc, t, out, 8, BITS); break;                                               \
        case 7: int_tile_m(wt, x, rows, xc, t, out, 7, BITS); break;                                               \
        case 6: int_tile_m(wt, x, rows, xc, t, out, 6, BITS); break;                                               \
        case 5: int_tile_m(wt, x, rows, xc, t, out, 5, BITS); break;                                               \
        case 4: int_tile_m(wt, x, rows, xc, t, out, 4, BITS); break;                                               \
        case 3: int_tile_m(wt, x, rows, xc, t, out, 3, BITS); break;                                               \
        case 2: int_tile_m(wt, x, rows, xc, t, out, 2, BITS); break;                                               \
        default: int_tile_m(wt, x, rows, xc, t, out, 1, BITS);                                                     \
    }

static __attribute__((target(TILE_TARGET))) void int_tile(const qinfer_weight *wt, const x_rows *x, const int *rows,
                                                          const int8_t *xc, int64_t t, float *out, int R) {
    if (wt->bits == 8) {
        INT_TILE_ROWS(8)
    } else {
        INT_TILE_ROWS(4)
    }
}
#else
static void int_tile(const qinfer_weight *wt, const x_rows *x, const int *rows, const int8_t *xc, int64_t t,
                     float *out, int R) {}  /* never called: no VNNI loop here */
#endif

/* Attention over int8 codes by integer dot products (AVX512-VNNI): the fp32 loops above do 4 FMAs per query
 * head, position and channel on codes of one byte, which on a 2-core CPU binds before the memory does. Each query
 * head (already times the channel scales) is put in 15-bit fixed point with its own step sq = max |q| / 32767
 * (within sq / 2 of each q, where bf16 keeps 2^-9 of q itself) and VPDPWSSD multiplies it with the codes widened
 * to 16 bits, 32 products a lane-pair instruction, exact in int32 (|sum| < 32767 * 128 * D < 2^31 for D <= 512);
 * the score is that sum * sq * scale * t_j. Half-precision queries only (an fp32 row keeps the float loop, as
 * the 4-bit GEMV does). The values' weighted sums: in 16-lane fp32, 64 columns a pass in four registers per head
 * (weighted_i8, the switch's 1), or in integers too (weighted_i8_int, 2: the default), the softmax weights in
 * 15-bit fixed point per block of 16 positions against pairs of positions' codes. D a multiple of 32. */
#if QINFER_VNNI
#define I8_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"

static inline __attribute__((always_inline, target(I8_TARGET))) void scores_i8_m(
        const rows_t *kr_, const rows_t *vr_, const int16_t *qi, const float *qs, int64_t D, int64_t j0, int64_t j1,
        float *sc, int64_t n, const rows_t *kp, const int M, float *top) {
    for (int i = 0; i < M; i++) top[i] = -INFINITY;
    const int64_t ahead = AHEAD / D > 1 ? AHEAD / D : 1;
    for (int64_t j = j0; j < j1; j++) {
        const char *kr = row_at(kr_, j, 1);
        if (j + ahead < j1) {
            const char *next = row_at(kr_, j + ahead, 1);
            for (int64_t o = 0; o < D; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        if (vr_) {
            const char *vr = row_at(vr_, j, 1);
            for (int64_t o = 0; o < D; o += 64) _mm_prefetch(vr + o, _MM_HINT_T1);
        }
        __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                        _mm512_setzero_si512()};
        for (int64_t d = 0; d < D; d += 32) {
            __m512i kc = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + d)));
            for (int i = 0; i < M; i++)
                a[i] = _mm512_dpwssd_epi32(a[i], _mm512_loadu_si512((const void *)(qi + i * D + d)), kc);
        }
        const float tj = kp ? *(const float *)row_at(kp, j, sizeof(float)) : 1.f;
        /* the M sums at once: 512 -> 256 -> 128 bits per head, then two rounds of pairwise adds across heads */
        __m128i h[4];
        for (int i = 0; i < 4; i++) {
            __m256i t = _mm256_add_epi32(_mm512_castsi512_si256(a[i]), _mm512_extracti64x4_epi64(a[i], 1));
            h[i] = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        }
        int32_t sums[4];
        _mm_storeu_si128((__m128i *)sums, _mm_hadd_epi32(_mm_hadd_epi32(h[0], h[1]), _mm_hadd_epi32(h[2], h[3])));
        for (int i = 0; i < M; i++) {
            float x = (float)sums[i] * qs[i] * tj;
            sc[i * n + j - j0] = x;
            if (x > top[i]) top[i] = x;
        }
    }
}

static __attribute__((target(I8_TARGET))) void scores_i8(
        const rows_t *kr, const rows_t *vr, const float *qf, int64_t G, int64_t D, int64_t j0, int64_t j1,
        float *sc, int64_t n, float scale, const rows_t *kp, float *top) {
    int16_t q16[G * D];
    float qs[G];
    for (int64_t i = 0; i < G; i++) {
        float m = 0.f;
        for (int64_t d = 0; d < D; d++) m = fmaxf(m, fabsf(qf[i * D + d]));
        const float sq = m > 0.f ? m / 32767.f : 1.f;
        for (int64_t d = 0; d < D; d++) q16[i * D + d] = (int16_t)lrintf(qf[i * D + d] / sq);
        qs[i] = sq * scale;
    }
    for (int64_t i0 = 0; i0 < G; i0 += 4) {
        const int m = G - i0 < 4 ? (int)(G - i0) : 4;
        const rows_t *vpre = i0 ? NULL : vr;
        const int16_t *qi = q16 + i0 * D;
        float *si = sc + i0 * n;
        switch (m) {
            case 4: scores_i8_m(kr, vpre, qi, qs + i0, D, j0, j1, si, n, kp, 4, top + i0); break;
            case 3: scores_i8_m(kr, vpre, qi, qs + i0, D, j0, j1, si, n, kp, 3, top + i0); break;
            case 2: scores_i8_m(kr, vpre, qi, qs + i0, D, j0, j1, si, n, kp, 2, top + i0); break;
            default: scores_i8_m(kr, vpre, qi, qs + i0, D, j0, j1, si, n, kp, 1, top + i0);
        }
    }
}

static inline __attribute__((always_inline, target(I8_TARGET))) void weighted_i8_m(
        const rows_t *vr_, const float *p, int64_t n, int64_t j0, int64_t D, float *acc, const int M) {
    for (int64_t d = 0; d < D; d += 64) {  /* 64 columns a pass (D % 64 == 32: the last pass takes 32) */
        const int c = D - d >= 64 ? 4 : 2;  /* 16-lane registers of columns */
        __m512 s[4][4];
        for (int i = 0; i < M; i++)
            for (int r = 0; r < 4; r++) s[i][r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const char *vr = row_at(vr_, j0 + j, 1) + d;
            __m512 v[4];
            for (int r = 0; r < c; r++)
                v[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(vr + 16 * r))));
            for (int i = 0; i < M; i++) {
                __m512 pj = _mm512_set1_ps(p[i * n + j]);
                for (int r = 0; r < c; r++) s[i][r] = _mm512_fmadd_ps(pj, v[r], s[i][r]);
            }
        }
        for (int i = 0; i < M; i++)
            for (int r = 0; r < c; r++) _mm512_storeu_ps(acc + i * D + d + 16 * r, s[i][r]);
    }
}

/* weighted_i8 and weighted_i8_int: the query heads 4 at a time through one loop of values (fn: built for each count
 * of heads, a constant where inlined) */
#define WEIGHTED_BY_HEADS(name, fn)                                                                                \
static __attribute__((target(I8_TARGET))) void name(const rows_t *vr, const float *p, int64_t n, int64_t j0,       \
                                                    int64_t D, float *acc, int64_t G) {                            \
    for (int64_t i0 = 0; i0 < G; i0 += 4) {                                                                        \
        const int m = G - i0 < 4 ? (int)(G - i0) : 4;                                                             \
        switch (m) {                                                                                               \
            case 4: fn(vr, p + i0 * n, n, j0, D, acc + i0 * D, 4); break;                                          \
            case 3: fn(vr, p + i0 * n, n, j0, D, acc + i0 * D, 3); break;                                          \
            case 2: fn(vr, p + i0 * n, n, j0, D, acc + i0 * D, 2); break;                                          \
            default: fn(vr, p + i0 * n, n, j0, D, acc + i0 * D, 1);                                                \
        }                                                                                                          \
    }                                                                                                              \
}

WEIGHTED_BY_HEADS(weighted_i8, weighted_i8_m)

/* The values' weighted sums by integer dot products: acc[i] = sum_j p[i * n + j] v_(j0 + j), as weighted_i8, for M
 * (1-4) heads in blocks of 16 positions (from j0, so a sequence's blocks follow its own chunks). In each block each
 * head's weights (already times the values' position scales) go to 15-bit fixed point with the block's own step
 * mx / 32767, mx their largest: a weight is within step / 2 = mx / 65534 of itself, so a block's sum is within 16
 * mx / 65534 |v|max, and all blocks' within 2^-12 sum_j p_j |v|max (each mx is at most its block's sum): 2^-12 of the
 * values' range where the output's bf16 rounding is 2^-9 of itself. Two positions' rows of codes are interleaved
 * in registers (unpack the bytes of rows j and j+1, widen to 16 bits: each 32-bit lane holds one column of both),
 * so VPDPWSSD against the broadcast pair (w_j, w_j+1) adds both products to that column's int32 sum, exact (16
 * products of at most 32767 * 128 < 2^31). At the block's end the sums join acc in fp32, times the step. The
 * unpack puts columns 0-7 and 16-23 of 32 in one register, 8-15 and 24-31 in the next: acc holds them in that
 * order until the end. A block whose largest weight is below 32767 FLT_MIN (2^-111) counts as 0 (at most 2^-100
 * of the values' range per block, next to a chunk's weights' sum of at least e^0 = 1 times a position scale); one
 * with a NaN or infinite weight makes the head's sums NaN. */
static inline __attribute__((always_inline, target(I8_TARGET))) void weighted_int_pass(
        const char *const *rows, const int16_t *w, int64_t d, float *acc, int64_t D, const __m512 *step, const int M,
        const int R) {
    __m512i s[4][8];
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) s[i][r] = _mm512_setzero_si512();
    for (int k = 0; k < 16; k += 2) {
        __m512i wk[4];
        for (int i = 0; i < M; i++) {
            int32_t pair;
            memcpy(&pair, w + i * 16 + k, sizeof(pair));
            wk[i] = _mm512_set1_epi32(pair);
        }
        for (int u = 0; u < R / 2; u++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(rows[k] + d + 32 * u));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(rows[k + 1] + d + 32 * u));
            const __m512i lo = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
            const __m512i hi = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
            for (int i = 0; i < M; i++) {
                s[i][2 * u] = _mm512_dpwssd_epi32(s[i][2 * u], lo, wk[i]);
                s[i][2 * u + 1] = _mm512_dpwssd_epi32(s[i][2 * u + 1], hi, wk[i]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) {
            float *a = acc + i * D + d + 16 * r;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][r]), step[i], _mm512_loadu_ps(a)));
        }
}

static inline __attribute__((always_inline, target(I8_TARGET))) void weighted_int_m(
        const rows_t *vr_, const float *p, int64_t n, int64_t j0, int64_t D, float *acc, const int M) {
    for (int i = 0; i < M; i++) memset(acc + i * D, 0, sizeof(float) * D);
    const int R = M <= 2 ? 8 : 4;  /* 16-lane registers of columns a pass: M R int32 sums in registers */
    const char *rows[16];
    int16_t w[4 * 16];
    __m512 step[4];
    for (int64_t jb = 0; jb < n; jb += 16) {
        const int m = n - jb < 16 ? (int)(n - jb) : 16;
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        int any = 0;
        for (int i = 0; i < M; i++) {
            const __m512 pi = _mm512_maskz_loadu_ps(live, p + i * n + jb);
            const float mx = _mm512_reduce_max_ps(pi);
            if (_mm512_cmp_ps_mask(pi, pi, _CMP_UNORD_Q) || !(mx <= FLT_MAX)) {
                step[i] = _mm512_set1_ps(NAN);
                memset(w + i * 16, 0, 32);
                any = 1;
            } else if (mx < 32767.f * FLT_MIN) {
                step[i] = _mm512_setzero_ps();
                memset(w + i * 16, 0, 32);
            } else {
                step[i] = _mm512_set1_ps(mx / 32767.f);
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(pi, _mm512_set1_ps(32767.f / mx)));
                _mm256_storeu_si256((__m256i *)(w + i * 16), _mm512_cvtepi32_epi16(q));
                any = 1;
            }
        }
        if (!any) continue;
        for (int k = 0; k < 16; k++) rows[k] = row_at(vr_, j0 + jb + (k < m ? k : m - 1), 1);  /* weight 0 past n */
        if (jb + 16 < n)  /* the next block's rows from L2 (the scores' loop sent them there) while this one sums */
            for (int k = 0; k < 16 && jb + 16 + k < n; k++) {
                const char *next = row_at(vr_, j0 + jb + 16 + k, 1);
                for (int64_t o = 0; o < D; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
            }
        int64_t d = 0;
        for (; d + 16 * R <= D; d += 16 * R) weighted_int_pass(rows, w, d, acc, D, step, M, R);
        for (; d + 64 <= D; d += 64) weighted_int_pass(rows, w, d, acc, D, step, M, 4);
        for (; d < D; d += 32) weighted_int_pass(rows, w, d, acc, D, step, M, 2);
    }
    for (int i = 0; i < M; i++)  /* columns back in order: 0-7 | 16-23 and 8-15 | 24-31 become 0-15 and 16-31 */
        for (int64_t d = 0; d < D; d += 32) {
            float *a = acc + i * D + d;
            const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
            _mm512_storeu_ps(a, _mm512_shuffle_f32x4(lo, hi, 0x44));
            _mm512_storeu_ps(a + 16, _mm512_shuffle_f32x4(lo, hi, 0xEE));
        }
}

WEIGHTED_BY_HEADS(weighted_i8_int, weighted_int_m)
#else
static void scores_i8(const rows_t *kr, const rows_t *vr, const float *qf, int64_t G, int64_t D, int64_t j0,
                      int64_t j1, float *sc, int64_t n, float scale, const rows_t *kp, float *top) {}
static void weighted_i8(const rows_t *vr, const float *p, int64_t n, int64_t j0, int64_t D, float *acc, int64_t G) {}
static void weighted_i8_int(const rows_t *vr, const float *p, int64_t n, int64_t j0, int64_t D, float *acc,
                            int64_t G) {}
#endif

/* -1: not asked yet; then which loops int8 codes take: 0 the fp32 ones, 1 the integer scores (the values' sums in
 * fp32), 2 the integer scores and values' sums */
static int i8_vnni = -1;

static int attention_i8_vnni(void) {
    if (i8_vnni < 0) i8_vnni = vnni_on_cpu(2) && __builtin_cpu_supports("avx512bw") ? 2 : 0;
    return i8_vnni;
}

/* Which loops attention over int8 codes takes: 0 the fp32 ones, 1 or 2 the integer loops above (1: the scores
 * only; 2, where the CPU has AVX512-VNNI and AVX512BW: the scores and the values' sums), any other value only
 * asks. Returns the setting before. */
int qinfer_attention_i8_vnni(int on) {
    int before = attention_i8_vnni();
    if (on == 0 || ((on == 1 || on == 2) && vnni_on_cpu(2) && __builtin_cpu_supports("avx512bw"))) i8_vnni = on;
    return before;
}

static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 8 codes of B bits (2 or 3) from the B bytes they fill (code j at bits B*j of the little-endian word),
 * widened to fp32: the word in every lane, each lane shifted by its own B*j and masked. */
static inline __attribute__((always_inline)) __m256 narrow8(const uint8_t *p, const int B) {
    uint32_t w = B == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8
                        : (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
    const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
    __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), _mm256_set1_epi32((1 << B) - 1));
    return _mm256_cvtepi32_ps(q);
}

/* x_rows of x [M, K] for codes of B bits in groups of G; loop: the VNNI loop 4-bit rows may take (0: none).
 * NULL when out of memory. */
static x_rows *prepare_rows(const void *x, int dtype, int64_t M, int64_t K, int64_t G, int B, int loop) {
    const int64_t ng = K / G;
    x_rows *r = malloc(sizeof(x_rows) + sizeof(float) * M * (K + 2 * ng) + sizeof(int) * M + 2 * M * K);
    if (!r) return NULL;
    r->xf = (float *)(r + 1), r->xs = r->xf + M * K, r->step = r->xs + M * ng;
    r->vnni = (int *)(r->step + M * ng), r->xh = (int8_t *)(r->vnni + M), r->xl = r->xh + M * K;
    for (int64_t m = 0; m < M; m++) {
        const char *xm = (const char *)x + m * K * esize(dtype);
        float *xf = r->xf + m * K, *xs = r->xs + m * ng, *step = r->step + m * ng;
        int8_t *xh = r->xh + m * K, *xl = r->xl + m * K;
        int vnni = loop != 0;
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f, top = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G && B == 4; k += 2) {
                float a = load_one(xm, dtype, k), c = load_one(xm, dtype, k + 1);
                const int64_t at = k / 16 * 16 + k % 16 / 2;
                xf[at] = a, xf[at + 8] = c, s += a + c;
                top = fmaxf(top, fmaxf(fabsf(a), fabsf(c)));
            }
            for (int64_t k = g * G; k < (g + 1) * G && B != 4; k++) s += (xf[k] = load_one(xm, dtype, k));
            xs[g] = s;
            step[g] = top / 16383.f;
            /* a NaN or infinity in x: the float loop, which carries it to y; so too a group whose step would be
             * subnormal (x near 1e-34 at most), whose steps would lose their precision */
            vnni &= isfinite(s) && isfinite(top) && (top == 0.f || top >= 16383.f * FLT_MIN);
        }
        r->vnni[m] = vnni;
        for (int64_t g = 0; g < ng && vnni; g++) {
            const float to_int = step[g] > 0.f ? 1.f / step[g] : 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {  /* even k at xh[k / 2], odd k at xh[K / 2 + k / 2] */
                int32_t i = (int32_t)lrintf(load_one(xm, dtype, k) * to_int), h = (i + 128) >> 8;
                xh[k % 2 * (K / 2) + k / 2] = (int8_t)h, xl[k % 2 * (K / 2) + k / 2] = (int8_t)(i - 256 * h);
            }
        }
    }
    return r;
}

/* A group's G codes of B bits at p to fp32 in w, in x_rows' order (4 bits: each 8 bytes' low nibbles, then their
 * high ones) */
static inline __attribute__((always_inline)) void widen_group(const uint8_t *p, int64_t G, float *w, const int B) {
    for (int64_t k = 0; k < G; k += B == 4 ? 16 : 8) {
        if (k % 32 == 0) PREFETCH(p + k * B / 8);
        if (B == 4) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k / 2)));
            _mm256_storeu_ps(w + k, _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0xF))));
            _mm256_storeu_ps(w + k + 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)));
        } else {
            _mm256_storeu_ps(w + k, B == 8 ? u8x8(p + k) : narrow8(p + k * B / 8, B));
        }
    }
}

/* A group's sum of G codes (widened to fp32 in w) against x in the same order: four sums over 32 codes at a
 * time, then 8 at a time into the first (pairs = 1: alternately the first and second, as 4-bit codes' last 16
 * split into their even and odd ones) */
static inline __m256 group_dot(const float *w, const float *x, int64_t G, int pairs) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= G; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < G; k += 8) {
        if (pairs && k % 16) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a1);
        else a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    }
    return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

/* Weight row n of B-bit codes against the rows of x that take the float loop: per group, its codes widened to
 * fp32 once (w: G floats), then for each row s * (sum q x - z * sum x), the first term into the row's acc [8],
 * the zero term into its zacc, summed apart */
static void int_float_rows(const qinfer_weight *wt, const x_rows *x, int64_t M, int64_t n, float *w, float *acc,
                           float *zacc) {
    const uint8_t *Z = wt->zero;
    const uint16_t *S = wt->scale;
    const int64_t K = wt->K, G = wt->group, ng = K / G, B = wt->bits;
    const uint8_t *q = (const uint8_t *)wt->w + n * (K * B / 8);
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *p = q + g * G * B / 8;
        switch (B) {  /* the loop built for each width */
            case 2: widen_group(p, G, w, 2); break;
            case 3: widen_group(p, G, w, 3); break;
            case 4: widen_group(p, G, w, 4); break;
            default: widen_group(p, G, w, 8);
        }
        const int64_t sg = n * ng + g;
        const float s = _cvtsh_ss(S[sg]), z = Z ? (float)Z[sg] : (float)(1 << (B - 1));
        for (int64_t m = 0; m < M; m++) {
            if (x->vnni[m]) continue;
            __m256 d = group_dot(w, x->xf + m * K + g * G, G, B == 4);
            _mm256_storeu_ps(acc + 8 * m, _mm256_fmadd_ps(_mm256_set1_ps(s), d, _mm256_loadu_ps(acc + 8 * m)));
            zacc[m] += s * z * x->xs[m * ng + g];
        }
    }
}

/* Weight row after weight row (split over the threads): the float loop (int_float_rows) for the rows of x (r) that
 * take it, the VNNI loop (INT4_ROWS_VNNI, loop 1 or 2; 0: none) for the others, or none for them where skip (the
 * loop over tiles has stored theirs); then each row's sums, less its zero term, stored. */
static int int_rows_gemv(const qinfer_weight *wt, const x_rows *r, const void *b, void *y, int64_t M, int dtype,
                         int loop, int skip) {
    const int64_t N = wt->N, G = wt->group;
    int floats = 0, vnnis = 0;
    for (int64_t m = 0; m < M; m++) vnnis += r->vnni[m], floats += !r->vnni[m];
    const int4_rows_vnni_fn rows_vnni = vnnis && !skip ? int4_rows_vnni[loop] : NULL;
    int failed = 0;
    #pragma omp parallel
    {
        /* a group widened (the float loop) or unpacked (the VNNI loop); each row's acc [8] and zacc */
        float *w = malloc(sizeof(float) * (G + 9 * M) + G);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!w) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            float *acc = w + G, *zacc = acc + 8 * M;
            memset(acc, 0, sizeof(float) * 9 * M);
            if (floats) int_float_rows(wt, r, M, n, w, acc, zacc);
            if (rows_vnni) rows_vnni(wt, r, M, n, (uint8_t *)(zacc + M), acc, zacc);
            for (int64_t m = 0; m < M; m++)
                if (!(skip && r->vnni[m]))
                    store_out(y, b, dtype, m, N, n, hsum(_mm256_loadu_ps(acc + 8 * m)) - zacc[m]);
        }
        free(w);
    }
    return failed;
}

/* x [M, K] (bf16 or fp16) as the loop over tiles reads it: per row m and group g, xs (sum of x), step (max |x| /
 * 16383: INT4_ROWS_VNNI's fixed point) and each x's high and low bytes in column order (xc: row m's at 2 m K, then K
 * on); ok[m] where the row takes the loop (as prepare_rows decides: its x and steps finite, no step subnormal).
 * 16 entries at a time. */
#if QINFER_VNNI
static __attribute__((target(TILE_TARGET))) void prepare_tiled(const void *x, int dtype, int64_t M, int64_t K,
                                                               int64_t G, int *ok, float *xs, float *step, int8_t *xc) {
    const int64_t ng = K / G;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = (const uint16_t *)x + m * K;
        int good = 1;
        for (int64_t g = 0; g < ng; g++) {
            __m512 s = _mm512_setzero_ps(), top = s;
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(xm + k));
                __m512 v = dtype == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                      : _mm512_cvtph_ps(h);
                s = _mm512_add_ps(s, v), top = _mm512_max_ps(top, _mm512_abs_ps(v));
            }
            /* a NaN in x: s is NaN (max would drop it); an infinity: s infinite or NaN */
            const float sum = _mm512_reduce_add_ps(s), mx = _mm512_reduce_max_ps(top);
            xs[m * ng + g] = sum, step[m * ng + g] = mx / 16383.f;
            good &= isfinite(sum) && isfinite(mx) && (mx == 0.f || mx >= 16383.f * FLT_MIN);
        }
        ok[m] = good;
        for (int64_t g = 0; g < ng && good; g++) {
            const float st = step[m * ng + g];
            const __m512 to_int = _mm512_set1_ps(st > 0.f ? 1.f / st : 0.f);
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(xm + k));
                __m512 v = dtype == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                      : _mm512_cvtph_ps(h);
                __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, to_int));  /* to nearest even, as lrintf */
                __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(128)), 8);
                __m512i lo = _mm512_sub_epi32(i, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(xc + 2 * m * K + k), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(xc + 2 * m * K + K + k), _mm512_cvtepi32_epi8(lo));
            }
        }
    }
}
#else
static void prepare_tiled(const void *x, int dtype, int64_t M, int64_t K, int64_t G, int *ok, float *xs, float *step,
                          int8_t *xc) {}  /* never called: no VNNI loop here */
#endif

/* 8-bit codes against M rows of x by AMX (TDPBSUD: 16 x 64 signed bytes times 64 x 16 unsigned bytes, summed into 16 x
 * 16 int32), the work of int_tile_m's 8-bit loop on tiles: x's fixed-point high and low bytes (prepare_tiled's, of
 * the rows that take the loop, 16 a block, zero rows past them) are the A operand, repacked per call (amx8_pack) per
 * group into 16 rows of P = G rounded up to 64 bytes, zeros past G; the weight's tiles as int4_tiles.py lays them out
 * are the B operand as they are (64 columns' 1 KiB: 16 rows of 4 columns x 16 output rows); the C tiles hold 16 rows
 * of x x 16 output rows, one for the high bytes and one for the low. The codes are unsigned and x signed, so x is A
 * and the weight B: C = x W^T, whose rows are each row of x's 16 outputs, as int_tile_m's lanes. A group's last
 * chunk of 64 columns may reach past the group: its B rows there hold the next group's codes (or, past the last
 * tile, a zero-padded copy's), which meet x's zero columns. The sums over a group are exact in int32 (G <= 512, as
 * the VNNI loop needs), so they are the integers the VNNI loop sums, in another order; at the group's end they
 * become t = 256 sum q h + sum q l and s (t step - z sum x) in fp32 by the same operations in the same order as
 * int_tile_m's: the outputs are the VNNI loop's bit for bit, and each output's arithmetic depends on its own row of
 * x alone. The tiles need the OS's leave (amx_on_cpu) and a configuration per thread (AMX_CONFIG's shapes: 16 rows
 * of 64 bytes for every tile). */
#if QINFER_BF16_AMX && QINFER_VNNI
#define I8_AMX_TARGET TILE_TARGET ",avx512bw,amx-tile,amx-int8"

/* The fixed-point bytes (xc, as prepare_tiled writes them) of x rows rows[0..nv) as A tiles: for block c of 16 rows
 * and group g, 16 rows of high bytes then 16 of low ones, P bytes apart, at xa + (c ng + g) 32 P; zeros past nv and
 * past G */
static void amx8_pack(const int8_t *xc, const int *rows, int64_t nv, int64_t K, int64_t G, int64_t P, int8_t *xa) {
    const int64_t ng = K / G;
    memset(xa, 0, (size_t)((nv + 15) / 16 * ng * 32 * P));
    for (int64_t i = 0; i < nv; i++)
        for (int64_t g = 0; g < ng; g++)
            for (int hl = 0; hl < 2; hl++)
                memcpy(xa + ((i / 16 * ng + g) * 32 + 16 * hl + i % 16) * P, xc + 2 * rows[i] * K + hl * K + g * G,
                       (size_t)G);
}

/* 16 fp32 sums (v) plus their bias (b + n: 16 of dtype, or NULL) in fp32, each rounded once to dtype (bf16 or fp16)
 * and stored at y + at: store_out's bits, a NaN's included (bf16: its quiet bit set, as f32_to_bf16) */
static inline __attribute__((always_inline, target(I8_AMX_TARGET))) void amx8_out(const float *v, const void *b,
                                                                                 void *y, int dtype, int64_t at,
                                                                                 int64_t n) {
    __m512 f = _mm512_load_ps(v);
    if (b) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + n));
        f = _mm512_add_ps(f, dtype == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                        : _mm512_cvtph_ps(h));
    }
    __m256i out;
    if (dtype == 1) {
        const __m512i u = _mm512_castps_si512(f);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i up = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        up = _mm512_mask_or_epi32(up, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        out = _mm512_cvtepi32_epi16(up);
    } else {
        out = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), out);
}

/* Output tiles t and (TWO) t + 1 against block c of x's rows (rows 16 c.., nv in all): per group, C tiles 0-1 (high,
 * low bytes by tile t) and 2-3 (by tile t + 1) summed over its chunks of 64 columns (A tiles 4-5, B tiles 6-7), stored
 * to ct and added into acc (fp32: per tile, 16 rows of x x 16 outputs) as int_tile_m does; then stored into y (16 at
 * a time: amx8_out). The first block's pass prefetches the next pair of tiles' chunk into L2 as it goes. */
static inline __attribute__((always_inline, target(I8_AMX_TARGET))) void amx8_pass(
        const qinfer_weight *wt, const x_rows *x, const int *rows, int64_t nv, const int8_t *xa, int64_t P, int64_t c,
        int64_t t, const void *b, void *y, int dtype, uint8_t *part, int32_t *ct, float *acc, const int TWO) {
    const int64_t N = wt->N, K = wt->K, G = wt->group, ng = K / G, T = (N + 15) / 16, chunks = P / 64;
    const int64_t n_rows = nv - 16 * c < 16 ? nv - 16 * c : 16;
    for (int i = 0; i < 512; i++) acc[i] = 0.f;
    for (int64_t g = 0; g < ng; g++) {
        _tile_zero(0);
        _tile_zero(1);
        if (TWO) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t j = 0; j < chunks; j++) {
            const int64_t k = g * G + 64 * j;
            const int8_t *a = xa + (c * ng + g) * 32 * P + 64 * j;
            const uint8_t *w[2];
            for (int u = 0; u <= TWO; u++) {
                w[u] = wt->tiles + (t + u) * 16 * K + 16 * k;
                if (c == 0)
                    for (int i = 0; i < 1024; i += 64) _mm_prefetch((const char *)(w[u] + 32 * K + i), _MM_HINT_T1);
                if (t + u == T - 1 && k + 64 > K) {  /* past the last tile's end: a zero-padded copy */
                    COMPILER_BARRIER();
                    memset(part, 0, 1024);
                    memcpy(part, w[u], (size_t)(16 * (K - k)));
                    COMPILER_BARRIER();
                    w[u] = part;
                }
            }
            _tile_loadd(4, a, P);
            _tile_loadd(5, a + 16 * P, P);
            _tile_loadd(6, w[0], 64);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 5, 6);
            if (TWO) {
                _tile_loadd(7, w[1], 64);
                _tile_dpbsud(2, 4, 7);
                _tile_dpbsud(3, 5, 7);
            }
        }
        _tile_stored(0, ct, 64);
        _tile_stored(1, ct + 256, 64);
        if (TWO) {
            _tile_stored(2, ct + 512, 64);
            _tile_stored(3, ct + 768, 64);
        }
        COMPILER_BARRIER();
        for (int u = 0; u <= TWO; u++) {
            const float *sz = wt->tile_sz + (t + u) * ng * 32 + g * 32;
            const __m512 s = _mm512_loadu_ps(sz), z = _mm512_loadu_ps(sz + 16);
            for (int64_t r = 0; r < n_rows; r++) {
                const int64_t mg = rows[16 * c + r] * ng + g;
                const __m512i h = _mm512_load_si512((const void *)(ct + 512 * u + 16 * r));
                const __m512i l = _mm512_load_si512((const void *)(ct + 512 * u + 256 + 16 * r));
                __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(x->step[mg]));
                f = _mm512_fnmadd_ps(z, _mm512_set1_ps(x->xs[mg]), f);
                _mm512_store_ps(acc + 256 * u + 16 * r,
                                _mm512_fmadd_ps(f, s, _mm512_load_ps(acc + 256 * u + 16 * r)));
            }
        }
    }
    for (int u = 0; u <= TWO; u++) {
        const int64_t n0 = 16 * (t + u);
        for (int64_t r = 0; r < n_rows; r++) {
            if (n0 + 16 <= N) {
                amx8_out(acc + 256 * u + 16 * r, b, y, dtype, rows[16 * c + r] * N + n0, n0);
                continue;
            }
            for (int64_t j = 0; n0 + j < N; j++)  /* the last tile, in part */
                store_out(y, b, dtype, rows[16 * c + r], N, n0 + j, acc[256 * u + 16 * r + j]);
        }
    }
}

/* The rows rows[0..nv) of x that take the integer loops (x_rows r and xc from prepare_tiled) against 8-bit codes with
 * tiles built: x repacked (amx8_pack), then pairs of output tiles split over the threads, each pair meeting the
 * blocks of x in turn (a block after the first reads the pair's codes again from the caches). 1: out of memory. */
static __attribute__((target(I8_AMX_TARGET))) int int8_amx_gemv(const qinfer_weight *wt, const x_rows *r,
                                                                 const int *rows, int64_t nv, const int8_t *xc,
                                                                 const void *b, void *y, int dtype) {
    const int64_t K = wt->K, G = wt->group, P = (G + 63) / 64 * 64, T = (wt->N + 15) / 16, blocks = (nv + 15) / 16;
    int8_t *xa = aligned_alloc(64, (size_t)(blocks * (K / G) * 32 * P));
    if (!xa) return 1;
    amx8_pack(xc, rows, nv, K, G, P, xa);
    #pragma omp parallel
    {
        uint8_t part[1024] __attribute__((aligned(64)));
        int32_t ct[1024] __attribute__((aligned(64)));
        float acc[512] __attribute__((aligned(64)));
        _tile_loadconfig(&AMX_CONFIG);  /* the tiles' shapes are each thread's own state */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t += 2)
            for (int64_t c = 0; c < blocks; c++) {  /* the loop built for a pair of tiles or the last one alone */
                if (t + 1 < T)
                    amx8_pass(wt, r, rows, nv, xa, P, c, t, b, y, dtype, part, ct, acc, 1);
                else
                    amx8_pass(wt, r, rows, nv, xa, P, c, t, b, y, dtype, part, ct, acc, 0);
            }
        _tile_release();
    }
    free(xa);
    return 0;
}

/* Whether the CPU has AMX-INT8 (and the OS grants the tiles) beside the AVX512-VNNI loop's extensions */
static int int8_amx_on_cpu(void) {
    return vnni_on_cpu(2) && __builtin_cpu_supports("avx512bw") && amx_on_cpu(25);
}
#else
static int int8_amx_gemv(const qinfer_weight *wt, const x_rows *r, const int *rows, int64_t nv, const int8_t *xc,
                         const void *b, void *y, int dtype) {
    return 1;  /* never called: qinfer_int8_amx says no AMX */
}
static int int8_amx_on_cpu(void) { return 0; }
#endif

/* -1: not asked yet; then which loop 8-bit codes with tiles take: 0 the AVX512-VNNI one, 1 AMX-INT8 from
 * AMX8_MIN_ROWS rows of x on (the VNNI loop below: the same bits, and at a few rows the faster), 2 AMX-INT8 for any M */
static int int8_amx = -1;
#define AMX8_MIN_ROWS 5

/* Which loop qinfer_int_gemv's loop over tiles takes for 8-bit codes (at first 1 where AMX-INT8 runs here, else the
 * AVX512-VNNI loop): loop = 0 takes the VNNI loop, 1 or 2 AMX-INT8 (from AMX8_MIN_ROWS rows on, or always) where it
 * runs here (else leaves the setting), any other value only asks. Returns the setting before. */
int qinfer_int8_amx(int loop) {
    if (int8_amx < 0) int8_amx = int8_amx_on_cpu();
    int before = int8_amx;
    if (loop == 0 || ((loop == 1 || loop == 2) && int8_amx_on_cpu())) int8_amx = loop;
    return before;
}

/* M rows of x (bf16 or fp16) against 4- or 8-bit codes with tiles built (see qinfer_int_gemv): the rows that take
 * the VNNI loop through int_tile, tile after tile split over the threads, 8 rows a pass, their outputs stored (with
 * the bias), or for 8-bit codes where qinfer_int8_amx says so the AMX-INT8 loop (int8_amx_gemv: the same bits); any
 * others (a NaN or infinity) through the float loop (int_rows_gemv). */
static int int_tiles_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M, int dtype) {
    const int64_t N = wt->N, K = wt->K, G = wt->group, T = (N + 15) / 16, ng = K / G;
    x_rows *r = malloc(sizeof(x_rows) + sizeof(float) * 2 * M * ng + sizeof(int) * 2 * M + 2 * M * K);
    if (!r) return 1;
    r->xs = (float *)(r + 1), r->step = r->xs + M * ng, r->vnni = (int *)(r->step + M * ng);
    int *rows = r->vnni + M;
    int8_t *xc = (int8_t *)(rows + M);
    prepare_tiled(x, dtype, M, K, G, r->vnni, r->xs, r->step, xc);
    int64_t nv = 0, failed = 0;
    for (int64_t m = 0; m < M; m++)
        if (r->vnni[m]) rows[nv++] = (int)m;
    /* 8-bit codes: the AMX-INT8 loop where it is on (the same bits); else, and for 4-bit codes, the VNNI loop */
    const int amx = wt->bits == 8 && nv ? qinfer_int8_amx(-1) : 0;
    if (amx == 2 || (amx == 1 && nv >= AMX8_MIN_ROWS)) {
        failed = int8_amx_gemv(wt, r, rows, nv, xc, b, y, dtype);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float out[8 * 16];
            for (int64_t i = 0; i < nv; i += 8) {
                const int R = nv - i < 8 ? (int)(nv - i) : 8;
                int_tile(wt, r, rows + i, xc, t, out, R);
                for (int q = 0; q < R; q++)
                    for (int64_t j = 0; j < 16 && 16 * t + j < N; j++)
                        store_out(y, b, dtype, rows[i + q], N, 16 * t + j, out[16 * q + j]);
            }
        }
    }
    if (nv < M) {  /* the float loop's rows, prepared as it reads them */
        x_rows *f = prepare_rows(x, dtype, M, K, G, 4, 0);
        if (!f) failed = 1;
        else {
            memcpy(f->vnni, r->vnni, sizeof(int) * M);
            failed |= int_rows_gemv(wt, f, b, y, M, dtype, 0, 1);  /* an AMX-INT8 failure stays reported */
            free(f);
        }
    }
    free(r);
    return (int)failed;
}

/* codes: uint8 [N, K*bits/8], bits 2, 3, 4 or 8 (4 bits: byte i of a row holds code 2i in its low nibble, 2i+1
 * in its high one; 2 and 3 bits: as narrow8 reads them); scale: fp16 [N, K/G]; zero: uint8 [N, K/G] or NULL
 * (symmetric: 2^(bits-1)). K % G == 0 and G % 16 == 0 (2, 3 and 8 bits: G % 8 == 0). Per weight row, the float
 * loop (int_float_rows) for rows of x that take it, the VNNI loop (INT4_ROWS_VNNI) for the others; then each
 * row's sums, less its zero term. */
int qinfer_int_gemv(const qinfer_weight *wt, const void *x, const void *b, void *y, int64_t M, int dtype) {
    const int64_t K = wt->K, G = wt->group;
    /* a group's int32 lanes reach at most (G / 64) * 2 * 4 * 15 * 64 * 256 (+ the low bytes' far smaller sums):
     * below 2^31 for G up to 2^16. An fp32 row takes the float loop: x in 15-bit fixed point is finer than
     * bf16 but not fp32 (relative errors near 1e-4 where the float loop's are near 1e-6) */
    const int loop = wt->bits == 4 && dtype != 0 && G / 2 % 32 == 0 && G <= 65536 ? qinfer_int4_vnni(-1) : 0;
    if (loop == 2 && wt->tiles) return int_tiles_gemv(wt, x, b, y, M, dtype);
    /* 8-bit codes: a group's int32 lanes reach at most G * 255 * 16383 (|256 h + l| <= 16383): below 2^31 for G up
     * to 512; the tiles are built only for such groups of 16 or more (gemv_cpu._tiled) */
    if (wt->bits == 8 && wt->tiles && dtype != 0 && G % 16 == 0 && G <= 512 && qinfer_int4_vnni(-1) == 2)
        return int_tiles_gemv(wt, x, b, y, M, dtype);
    x_rows *r = prepare_rows(x, dtype, M, K, G, (int)wt->bits, loop);
    if (!r) return 1;
    int failed = int_rows_gemv(wt, r, b, y, M, dtype, loop, 0);
    free(r);
    return failed;
}

/* A prefill's other half: 4-bit codes [N, K/2] (as qinfer_int_gemv reads them) to the dense W [N, K] of dtype
 * that a GEMM takes, w = (q - z) * s computed in fp32 (q - z exact, one rounding for the product) and rounded
 * once to dtype (to nearest even), as qinfer.format.dequantize_codes and a cast compute it: the same bits.
 * One pass over the codes, 16 at a time (their nibbles back in column order), rows split over the threads.
 * K % G == 0 and G % 16 == 0. */
int qinfer_int4_dequantize(const qinfer_weight *wt, void *out, int dtype) {
    const uint8_t *Q = wt->w, *Z = wt->zero;
    const uint16_t *S = wt->scale;
    const int64_t N = wt->N, K = wt->K, G = wt->group, ng = K / G;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const __m128i m0f = _mm_set1_epi8(0x0F);
        const uint8_t *q = Q + n * (K / 2);
        for (int64_t g = 0; g < ng; g++) {
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(S[n * ng + g]));
            const __m256 z = _mm256_set1_ps(Z ? (float)Z[n * ng + g] : 8.f);
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(q + k / 2));
                __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, m0f), _mm_and_si128(_mm_srli_epi16(b, 4), m0f));
                __m256 w0 = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), z), s);
                __m256 w1 = _mm256_mul_ps(
                    _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8))), z), s);
                store8(out, dtype, n * K + k, w0);
                store8(out, dtype, n * K + k + 8, w1);
            }
        }
    }
    return 0;
}

/* 2-, 3- or 8-bit codes (as qinfer_int_gemv reads them) to W [N, K] of dtype, as
 * qinfer_int4_dequantize computes it (the format's numbers bit for bit), 8 codes at a time. G % 8 == 0. */
int qinfer_int_dequantize(const qinfer_weight *wt, void *out, int dtype) {
    const uint8_t *Q = wt->w, *Z = wt->zero;
    const uint16_t *S = wt->scale;
    const int64_t N = wt->N, K = wt->K, G = wt->group, ng = K / G, B = wt->bits;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = Q + n * K * B / 8;
        for (int64_t g = 0; g < ng; g++) {
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(S[n * ng + g]));
            const __m256 z = _mm256_set1_ps(Z ? (float)Z[n * ng + g] : (float)(1 << (B - 1)));
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                __m256 c = B == 8 ? u8x8(q + k) : B == 3 ? narrow8(q + k * 3 / 8, 3) : narrow8(q + k / 4, 2);
                store8(out, dtype, n * K + k, _mm256_mul_ps(_mm256_sub_ps(c, z), s));
            }
        }
    }
    return 0;
}

/* E4M3 codes [N, K] (rows ld apart; K % 8 == 0) to W [N, K] of dtype: w = (code / 2^8, exact in fp16) times
 * (scale * 2^8), one fp32 rounding, then one to dtype: qinfer.format.e4m3_times and a cast, the same bits. */
int qinfer_fp8_dequantize(const qinfer_weight *wt, void *out, int dtype) {
    const uint8_t *W = wt->w;
    const float *scale = wt->scale;
    const int64_t N = wt->N, K = wt->K, ldw = wt->ld, per_row = wt->group == N;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const __m256 s = _mm256_set1_ps(scale[per_row ? n : 0] * 256.f);
        for (int64_t k = 0; k < K; k += 8) store8(out, dtype, n * K + k, _mm256_mul_ps(e4m3x8(W + n * ldw + k), s));
    }
    return 0;
}

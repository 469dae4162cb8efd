/* A decode step's decoder layers in one call: M rows (one token each, of its own sequence and position) through
 * every layer and the final norm, over a paged bf16 KV cache. Built with gemv_cpu.c as one translation unit
 * (cpu_library.py appends this file to it), so it calls that file's kernels: qinfer_rms_norm, the GEMVs and
 * qinfer_paged_decode_attention. decode_cpu.py documents why; qinfer.model.decode_plan fills the structs.
 *
 * Each op between those kernels is the eager path's op on the same numbers, rounded where it rounds: a 16-bit
 * activation's elementwise ops (the residual adds, RoPE's two products and their sum, act(gate) * up) each
 * compute in fp32 and round once to the activations' dtype, as PyTorch's CPU ops on bf16 tensors do; the gate's
 * activation is read from a table of its value at each of the 65536 bit patterns, which PyTorch's own op
 * filled. So the step's outputs are the eager path's bit for bit. dtype codes as in gemv_cpu.c (1 = bf16,
 * 2 = fp16; fp32 rows take the eager path). Returns 0, or 1 when a kernel could not allocate its scratch.
 */

typedef struct {
    const qinfer_weight *w;  /* NULL: this linear is not used (a stacked group runs as one) */
    const void *bias;        /* [N] in the activations' dtype, or NULL */
    int64_t kind;            /* 0: bf16 weight (qinfer_bf16_gemv), 1: integer codes (qinfer_int_gemv), 2: FP8 */
} qinfer_linear;

typedef struct {
    const void *w;           /* [dim] of wdtype; NULL: no such norm */
    float eps, offset;
    int64_t wdtype, scale_in_fp32;
} qinfer_norm;

typedef struct {
    qinfer_norm input, post_attention, pre_feedforward, post_feedforward, q, k;
    qinfer_linear qkv, q_proj, k_proj, v_proj, o_proj, gate_up, gate, up, down;
    int64_t rope, window;    /* this layer's RoPE table and window: indexes into qinfer_step's */
    float scale;             /* the attention's score scale */
} qinfer_layer;

typedef struct {
    int64_t L, C, H, Hkv, D, F, dtype, sandwich;
    const uint16_t *act;     /* act(x) in dtype for each of the 65536 bit patterns x of dtype */
    qinfer_norm final_norm;
    const qinfer_layer *layers;
} qinfer_model;

typedef struct {
    int64_t M;
    void *x;                 /* [M, C]: the embedded tokens; the residual stream after the last layer on return */
    void *out;               /* [M, C]: the final norm of it */
    const int64_t *slots;    /* [M]: where each row's key and value go (block * P + row) */
    const int64_t *table;    /* [M, tb]: each row's block table */
    int64_t tb, P;
    const int64_t *ends;     /* [M]: each row's position + 1 */
    const int64_t *const *starts;  /* per window: [M], each row's first visible position */
    const void *const *cos, *const *sin;  /* per RoPE table: [M, D] of dtype (the sin's first half negated), */
    int64_t cs;                           /* its rows cs elements apart (0: one row for all) */
    void *const *k_pages, *const *v_pages;  /* per layer: [N, Hkv, P, D] of dtype */
} qinfer_step;

static int linear_rows(const qinfer_linear *l, const void *x, void *y, int64_t M, int dtype) {
    if (l->kind == 1) return qinfer_int_gemv(l->w, x, l->bias, y, M, dtype);
    if (l->kind == 2) return qinfer_fp8_gemv(l->w, x, l->bias, y, M, dtype);
    return qinfer_bf16_gemv(l->w, x, l->bias, y, M, dtype);
}

static void norm_rows(const qinfer_norm *n, const void *x, void *y, int64_t M, int64_t D, int dtype) {
    qinfer_rms_norm(x, n->w, y, M, D, n->eps, n->offset, dtype, (int)n->wdtype, (int)n->scale_in_fp32);
}

/* x[i] = x[i] + h[i] for n elements of dtype, rounded once */
static void add_rows(void *x, const void *h, int64_t n, int dtype) {
    for (int64_t i = 0; i < n; i++) store_one(x, dtype, i, load_one(x, dtype, i) + load_one(h, dtype, i));
}

/* RoPE of one head's row x [D] in place: x * cos + roll(x, D/2) * sin, each product and the sum rounded once */
static void rope_row(char *x, const void *cos, const void *sin, int64_t D, int dtype) {
    float t[D];
    for (int64_t d = 0; d < D; d++) t[d] = load_one(x, dtype, d);
    for (int64_t d = 0; d < D; d++) {
        float a = rounded(t[d] * load_one(cos, dtype, d), dtype);
        float b = rounded(t[(d + D / 2) % D] * load_one(sin, dtype, d), dtype);
        store_one(x, dtype, d, a + b);
    }
}

int qinfer_decode_layers(const qinfer_model *m, const qinfer_step *s) {
    const int dtype = (int)m->dtype;
    const int64_t M = s->M, C = m->C, H = m->H, Hkv = m->Hkv, D = m->D, F = m->F, P = s->P;
    const int64_t NQ = (H + 2 * Hkv) * D, esz = 2;
    /* scratch in dtype: h [M, C], qkv [M, NQ] (q, k, v side by side), attention [M, H D], o [M, C],
     * gate and up [M, 2F], hidden [M, F] */
    char *h = malloc(esz * M * (2 * C + NQ + H * D + 3 * F));
    if (!h) return 1;
    char *qkv = h + esz * M * C, *att = qkv + esz * M * NQ, *o = att + esz * M * H * D, *gu = o + esz * M * C;
    char *hid = gu + esz * M * 2 * F;
    int failed = 0;
    for (int64_t l = 0; l < m->L && !failed; l++) {
        const qinfer_layer *ly = m->layers + l;
        norm_rows(&ly->input, s->x, h, M, C, dtype);
        /* q, k, v [M, .] with rows NQ apart: one product of the stacked weight, or one each (M rows apart, then
         * moved beside each other) */
        if (ly->qkv.w) {
            failed |= linear_rows(&ly->qkv, h, qkv, M, dtype);
        } else {
            const int64_t n[3] = {H * D, Hkv * D, Hkv * D}, off[3] = {0, H * D, (H + Hkv) * D};
            const qinfer_linear *lin[3] = {&ly->q_proj, &ly->k_proj, &ly->v_proj};
            for (int i = 0; i < 3; i++) {
                failed |= linear_rows(lin[i], h, att, M, dtype);  /* (att: free until the attention) */
                for (int64_t r = 0; r < M; r++)
                    memcpy(qkv + esz * (r * NQ + off[i]), att + esz * r * n[i], esz * n[i]);
            }
        }
        for (int64_t r = 0; r < M; r++) {
            char *q = qkv + esz * r * NQ, *k = q + esz * H * D, *v = k + esz * Hkv * D;
            if (ly->q.w) {
                norm_rows(&ly->q, q, q, H, D, dtype);
                norm_rows(&ly->k, k, k, Hkv, D, dtype);
            }
            const char *cos = (const char *)s->cos[ly->rope] + esz * r * s->cs;
            const char *sin = (const char *)s->sin[ly->rope] + esz * r * s->cs;
            for (int64_t i = 0; i < H; i++) rope_row(q + esz * i * D, cos, sin, D, dtype);
            for (int64_t i = 0; i < Hkv; i++) rope_row(k + esz * i * D, cos, sin, D, dtype);
            const int64_t block = s->slots[r] / P, row = s->slots[r] % P;
            for (int64_t g = 0; g < Hkv; g++) {  /* the pages: [N, Hkv, P, D] */
                const int64_t at_page = ((block * Hkv + g) * P + row) * D;
                memcpy((char *)s->k_pages[l] + esz * at_page, k + esz * g * D, esz * D);
                memcpy((char *)s->v_pages[l] + esz * at_page, v + esz * g * D, esz * D);
            }
        }
        failed |= qinfer_paged_decode_attention(qkv, s->k_pages[l], s->v_pages[l], att, M, H, Hkv, D, NQ, D,
                                                ly->scale, dtype, dtype, NULL, NULL, NULL, NULL, s->table, s->tb, P,
                                                s->starts[ly->window], s->ends);
        failed |= linear_rows(&ly->o_proj, att, o, M, dtype);
        if (m->sandwich) norm_rows(&ly->post_attention, o, o, M, C, dtype);
        add_rows(s->x, o, M * C, dtype);
        norm_rows(m->sandwich ? &ly->pre_feedforward : &ly->post_attention, s->x, h, M, C, dtype);
        /* gate and up [M, .] with rows 2F apart, as q, k and v above */
        if (ly->gate_up.w) {
            failed |= linear_rows(&ly->gate_up, h, gu, M, dtype);
        } else {
            failed |= linear_rows(&ly->gate, h, hid, M, dtype);
            for (int64_t r = 0; r < M; r++) memcpy(gu + esz * r * 2 * F, hid + esz * r * F, esz * F);
            failed |= linear_rows(&ly->up, h, hid, M, dtype);
            for (int64_t r = 0; r < M; r++) memcpy(gu + esz * (r * 2 * F + F), hid + esz * r * F, esz * F);
        }
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *gate = (const uint16_t *)(gu + esz * r * 2 * F), *up = gate + F;
            for (int64_t f = 0; f < F; f++)
                store_one(hid, dtype, r * F + f, load_one(m->act, dtype, gate[f]) * load_one(up, dtype, f));
        }
        failed |= linear_rows(&ly->down, hid, o, M, dtype);
        if (m->sandwich) norm_rows(&ly->post_feedforward, o, o, M, C, dtype);
        add_rows(s->x, o, M * C, dtype);
    }
    if (!failed) norm_rows(&m->final_norm, s->x, s->out, M, C, dtype);
    free(h);
    return failed;
}

/* Greedy sampling's pick: out[m] = the index of the largest of row m's V logits (x: M rows of dtype, ld elements
 * apart), the first of a tie and the first NaN where the row holds one, as torch.max(dim=-1).indices picks it.
 * One pass for the largest value and whether a NaN is there (8 lanes: a lane's NaN is kept apart, since
 * _mm256_max_ps drops it), then one for the first index holding it. */
void qinfer_argmax(const void *x, int64_t M, int64_t V, int64_t ld, int dtype, int64_t *out) {
    const size_t esz = esize(dtype);
    for (int64_t m = 0; m < M; m++) {
        const char *row = (const char *)x + m * ld * esz;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t v = 0;
        for (; v + 8 <= V; v += 8) {
            __m256 e = load8(row, dtype, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, e);
        }
        float lanes[8], best;
        _mm256_storeu_ps(lanes, top);
        best = lanes[0];
        for (int i = 1; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (int64_t j = v; j < V; j++) {
            float e = load_one(row, dtype, j);
            any_nan |= e != e;
            best = e > best ? e : best;
        }
        const __m256 b8 = _mm256_set1_ps(best);
        int64_t found = -1, j = 0;
        for (; j + 8 <= V && found < 0; j += 8) {
            __m256 e = load8(row, dtype, j);
            int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(e, e, _CMP_UNORD_Q) : _mm256_cmp_ps(e, b8, _CMP_EQ_OQ));
            if (hit) found = j + __builtin_ctz(hit);
        }
        for (; j < V && found < 0; j++) {
            float e = load_one(row, dtype, j);
            if (any_nan ? e != e : e == best) found = j;
        }
        out[m] = found < 0 ? 0 : found;
    }
}

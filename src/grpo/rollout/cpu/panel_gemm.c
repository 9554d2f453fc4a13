/* Float32 matmul of a few rows against a weight kept in 16-column panels: the decode step's linears on x86 CPUs
 * with AVX2 and FMA (grpo/rollout/panels.py builds and calls it).
 *
 *   Y[M][N] = X[M][K] @ W^T (+ bias),  W packed as P[p][k][j] = W[16 p + j][k] (zero past N)
 *
 * W may come in parts (q, k and v; gate and up): `grpo_pack_panels` packs their rows one after the other, as if
 * they were one matrix, without concatenating them first.
 *
 * Each panel (16 columns, K x 16 floats) is read from memory once and multiplied with every row of X in blocks
 * of up to 6 rows (12 accumulators), while the panel DIST ahead is prefetched, so that reading the weights
 * overlaps the arithmetic (a decode step is bound by both). Panels are split over OpenMP threads (the runtime
 * torch's own linear algebra uses: this library names the same libgomp.so.1). Every output is one float32 sum
 * over k in order, fused multiply-adds: the rounding differs from MKL's blocked sums in the last bits only. */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define DIST 2

#define MICRO(R)                                                                                               \
    static void micro##R(int K, const float *X, int ldx, const float *P, float *out, int ldo, const float *pre, \
                         int blocks, int block) {                                                              \
        __m256 a0[R], a1[R];                                                                                   \
        for (int i = 0; i < R; i++) {                                                                          \
            a0[i] = _mm256_setzero_ps();                                                                       \
            a1[i] = _mm256_setzero_ps();                                                                       \
        }                                                                                                      \
        for (int k = 0; k < K; k++) {                                                                          \
            if (pre && k % blocks == block) _mm_prefetch((const char *)(pre + (size_t)k * 16), _MM_HINT_T2);   \
            __m256 w0 = _mm256_loadu_ps(P + (size_t)k * 16), w1 = _mm256_loadu_ps(P + (size_t)k * 16 + 8);     \
            for (int i = 0; i < R; i++) {                                                                      \
                __m256 x = _mm256_broadcast_ss(X + (size_t)i * ldx + k);                                       \
                a0[i] = _mm256_fmadd_ps(x, w0, a0[i]);                                                         \
                a1[i] = _mm256_fmadd_ps(x, w1, a1[i]);                                                         \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++) {                                                                          \
            _mm256_storeu_ps(out + (size_t)i * ldo, a0[i]);                                                    \
            _mm256_storeu_ps(out + (size_t)i * ldo + 8, a1[i]);                                                \
        }                                                                                                      \
    }
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)

/* a switch, not a table of function pointers: inlined, the blocks run ~35% faster (measured, 16 rows, AVX2) */
#define BLOCK(R) \
    case R:      \
        micro##R(K, x, K, panel, dst, ld, pre, blocks, b); \
        break;

int grpo_panel_gemm(int M, int N, int K, const float *X, const float *P, const float *bias, float *Y) {
    int panels = (N + 15) / 16, blocks = (M + 5) / 6;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        const float *panel = P + (size_t)p * K * 16;
        const float *pre = p + DIST < panels ? panel + (size_t)DIST * K * 16 : NULL;
        int cols = N - p * 16 < 16 ? N - p * 16 : 16;
        float tmp[6 * 16];
        for (int r = 0, b = 0; r < M; r += 6, b++) {
            int rows = M - r < 6 ? M - r : 6;
            float *out = Y + (size_t)r * N + (size_t)p * 16;
            int whole = cols == 16;
            const float *x = X + (size_t)r * K;
            float *dst = whole ? out : tmp;
            int ld = whole ? N : 16;
            switch (rows) {
                BLOCK(6) BLOCK(5) BLOCK(4) BLOCK(3) BLOCK(2) BLOCK(1)
            }
            for (int i = 0; i < rows; i++) {
                float *row = out + (size_t)i * N;
                if (!whole) memcpy(row, tmp + i * 16, (size_t)cols * sizeof(float));
                if (bias)
                    for (int j = 0; j < cols; j++) row[j] += bias[p * 16 + j];
            }
        }
    }
    return 0;
}

/* P = the panels of the rows of parts[0], parts[1], ... (rows[s] rows each, K columns, row-major), one after the
 * other: P[p][k][j] = row 16 p + j of the stacked parts, zero past their total. Panels are split over threads. */
int grpo_pack_panels(int count, const float *const *parts, const int *rows, int K, float *P) {
    int total = 0;
    for (int s = 0; s < count; s++) total += rows[s];
    int panels = (total + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        const float *src[16];
        for (int j = 0, s = 0, first = 0; j < 16; j++) {
            int r = p * 16 + j;
            while (s < count && r >= first + rows[s]) first += rows[s++];
            src[j] = s < count ? parts[s] + (size_t)(r - first) * K : NULL;
        }
        float *dst = P + (size_t)p * K * 16;
        int k = 0;
        for (int half = 0; half < 2; half++) { /* 8 rows x 8 k transposed in registers: one pass at memory speed */
            const float *const *s8 = src + 8 * half;
            int whole = 1;
            for (int j = 0; j < 8; j++) whole &= s8[j] != NULL;
            if (!whole) continue;
            for (k = 0; k + 8 <= K; k += 8) {
                __m256 r[8], t[8];
                for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(s8[j] + k);
                for (int j = 0; j < 8; j += 2) {
                    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
                }
                for (int j = 0; j < 8; j += 4) {
                    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
                    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
                }
                /* r[0..3]: rows 0-3 at k..k+7 interleaved by 128-bit lanes; r[4..7]: rows 4-7 */
                for (int c = 0; c < 4; c++) {
                    _mm256_storeu_ps(dst + (size_t)(k + c) * 16 + 8 * half, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
                    _mm256_storeu_ps(dst + (size_t)(k + c + 4) * 16 + 8 * half, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
                }
            }
            for (int kk = k; kk < K; kk++)
                for (int j = 0; j < 8; j++) dst[(size_t)kk * 16 + 8 * half + j] = s8[j][kk];
        }
        for (int half = 0; half < 2; half++) { /* a half panel with missing rows (past N): element by element */
            const float *const *s8 = src + 8 * half;
            int whole = 1;
            for (int j = 0; j < 8; j++) whole &= s8[j] != NULL;
            if (whole) continue;
            for (int kk = 0; kk < K; kk++)
                for (int j = 0; j < 8; j++) dst[(size_t)kk * 16 + 8 * half + j] = s8[j] ? s8[j][kk] : 0.0f;
        }
    }
    return 0;
}

/* ---- one decode step of a Llama-family model, every layer in one call -------------------------------------------
 *
 * The lean decoder's float32 step (grpo/rollout/lean_decoder.py, `_forward` with one token a row) written out, so
 * that a step is one call instead of ~35 small torch operators a layer (each a few microseconds of dispatch, which
 * at a decode step's few rows cost more than their arithmetic). Per layer, for B rows of hidden size D:
 *
 *   h = rmsnorm(x) * norm1;  [q k v] = h @ Wqkv^T (+b);  with qk_norm (Qwen3): each head of q and k RMS-normed
 *   over its HD values, times its row of qk_norm ((H + KVH) x HD);  q, k rotated (cos, sin: the model's rotary
 *   embedding);
 *   k, v written at position `pos` of the layer's key/value buffers (B, KVH, W, HD);
 *   a = softmax(q . K^T * scale + mask) V   (a query head reads key head h / (H / KVH); mask: 0 or -inf, (B, pos+1));
 *   x += a @ Wo^T (+b);  h = rmsnorm(x) * norm2;  [g u] = h @ Wgu^T (+b);  x += (silu(g) * u) @ Wdown^T (+b)
 *
 * The same operations in the same order as the torch path; sums run in another order (float32 rounding only). */
#include <math.h>
#include <stdlib.h>

/* sum of a[i] * b[i]: eight lanes of fused multiply-adds, then the lanes and the tail */
static float dot(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* e^x for eight floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n; within
 * 2 ulp of expf over the float range; inputs clamped to +-88.38, where expf overflows or underflows anyway) */
static __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    /* 2^n in two factors, so that n = 128 (x near 88.7) does not overflow the exponent field */
    __m256i half = _mm256_cvtps_epi32(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
    __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
    __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, a), b);
}

/* v[i] = e^(v[i] - top); returns their sum */
static float exp_shifted(float *v, int n, float top) {
    __m256 t = _mm256_set1_ps(top), acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), t));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) total += lanes[j];
    for (; i < n; i++) total += (v[i] = expf(v[i] - top));
    return total;
}

/* out[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] */
static void silu_mul(const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void rms_norm_rows(int B, int D, const float *x, const float *w, float eps, float *out) {
    for (int b = 0; b < B; b++) {
        const float *r = x + (size_t)b * D;
        float s = dot(r, r, D);
        float rstd = 1.0f / sqrtf(s / D + eps);
        for (int i = 0; i < D; i++) out[(size_t)b * D + i] = w[i] * (r[i] * rstd);
    }
}

static void rope(float *v, const float *cos, const float *sin, int HD) {
    int half = HD / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

typedef struct {
    const float *norm1, *norm2, *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const float *qk_norm; /* NULL: no query/key norm */
    float *keys, *values;
} grpo_layer;

/* the layout of grpo_layer and the arguments of grpo_decode_layers: panels.py refuses a library of another */
int grpo_abi_version(void) { return 2; }

int grpo_decode_layers(int B, int L, int D, int H, int KVH, int HD, int I, float eps, float scale, int W, int pos,
                       const grpo_layer *layers, const float *cos, const float *sin, const float *mask, float *x) {
    int Q = H * HD, KV = KVH * HD, N = Q + 2 * KV, T = pos + 1, G = H / KVH;
    float *h = malloc(sizeof(float) * (size_t)B * D), *qkv = malloc(sizeof(float) * (size_t)B * N);
    float *att = malloc(sizeof(float) * (size_t)B * Q), *gu = malloc(sizeof(float) * (size_t)B * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)B * I), *res = malloc(sizeof(float) * (size_t)B * D);
    float *scores = malloc(sizeof(float) * (size_t)B * H * T);
    if (!h || !qkv || !att || !gu || !act || !res || !scores) {
        free(h), free(qkv), free(att), free(gu), free(act), free(res), free(scores);
        return 1;
    }
    for (int l = 0; l < L; l++) {
        const grpo_layer *ly = layers + l;
        rms_norm_rows(B, D, x, ly->norm1, eps, h);
        grpo_panel_gemm(B, N, D, h, ly->qkv, ly->qkv_bias, qkv);
        for (int b = 0; b < B; b++) {
            float *row = qkv + (size_t)b * N;
            for (int j = 0; j < H + KVH; j++) {
                float *head = row + (size_t)j * HD;
                if (ly->qk_norm) rms_norm_rows(1, HD, head, ly->qk_norm + (size_t)j * HD, eps, head);
                rope(head, cos + (size_t)b * HD, sin + (size_t)b * HD, HD);
            }
            for (int j = 0; j < KVH; j++) {
                size_t at = (((size_t)b * KVH + j) * W + pos) * HD;
                memcpy(ly->keys + at, row + Q + (size_t)j * HD, sizeof(float) * HD);
                memcpy(ly->values + at, row + Q + KV + (size_t)j * HD, sizeof(float) * HD);
            }
        }
#pragma omp parallel for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            int b = bh / H, head = bh % H, kvh = head / G;
            const float *q = qkv + (size_t)b * N + (size_t)head * HD;
            const float *K = ly->keys + ((size_t)b * KVH + kvh) * W * HD, *V = ly->values + ((size_t)b * KVH + kvh) * W * HD;
            const float *m = mask + (size_t)b * T;
            float *s = scores + (size_t)bh * T, top = -INFINITY;
            for (int t = 0; t < T; t++) {
                s[t] = dot(q, K + (size_t)t * HD, HD) * scale + m[t];
                if (s[t] > top) top = s[t];
            }
            float total = exp_shifted(s, T, top);
            float *out = att + (size_t)b * Q + (size_t)head * HD;
            for (int i = 0; i < HD; i++) out[i] = 0.0f;
            for (int t = 0; t < T; t++) {
                float p = s[t] / total;
                if (p != 0.0f)
                    for (int i = 0; i < HD; i++) out[i] += p * V[(size_t)t * HD + i];
            }
        }
        grpo_panel_gemm(B, D, Q, att, ly->o, ly->o_bias, res);
        for (size_t i = 0; i < (size_t)B * D; i++) x[i] += res[i];
        rms_norm_rows(B, D, x, ly->norm2, eps, h);
        grpo_panel_gemm(B, 2 * I, D, h, ly->gate_up, ly->gate_up_bias, gu);
        for (int b = 0; b < B; b++) silu_mul(gu + (size_t)b * 2 * I, gu + (size_t)b * 2 * I + I, act + (size_t)b * I, I);
        grpo_panel_gemm(B, D, I, act, ly->down, ly->down_bias, res);
        for (size_t i = 0; i < (size_t)B * D; i++) x[i] += res[i];
    }
    free(h), free(qkv), free(att), free(gu), free(act), free(res), free(scores);
    return 0;
}

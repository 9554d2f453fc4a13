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
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 16; j++) dst[(size_t)k * 16 + j] = src[j] ? src[j][k] : 0.0f;
    }
    return 0;
}

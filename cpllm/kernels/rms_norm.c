/* RMSNorm of float32 rows: out = w * (x / sqrt(mean(x^2) + eps)), the order transformers computes it in.
 *
 * torch's CPU rms_norm is a composite of six ops (about 20 us on one decode row of SmolLM2's width); this is one
 * pass over the row. The sum of squares runs in 16 float32 lanes, as torch's vectorized reductions do, so results
 * differ from torch's only by the order of that sum (a few units in the last place of the scale).
 */
#include <math.h>
#include <stdint.h>

enum { LANES = 16 };

static void norm_row(const float *restrict x, const float *restrict w, float eps, int64_t width,
                     float *restrict out) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += x[i + l] * x[i + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += lanes[l];
    for (; i < width; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)width + eps);
    for (int64_t j = 0; j < width; j++) out[j] = w[j] * (x[j] * scale);
}

/* Row r of x starts at (r / groups) * stride + (r % groups) * width: groups = 1, stride = width for contiguous
 * rows; groups = heads for per-head norms of q or k still inside the fused q|k|v rows (no copy out first). */
void cpllm_rms_norm(const float *x, const float *w, float eps, int64_t rows, int64_t width, int64_t groups,
                    int64_t stride, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + (r / groups) * stride + (r % groups) * width, w, eps, width, out + r * width);
}

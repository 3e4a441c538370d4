/* The fused loss's softmax for one chunk of rows on the CPU (modeling/cpu_softmax.py builds and loads this file).

For each row of logits (rows x vocab, bf16 or fp32, as the head's product wrote them) and its target id: the row's
loss, -log p(target), and, written over the logits in place, d(loss)/d(logits) = (softmax - onehot) * scale.
One row at a time, so that its values stay in the core's L2 cache through the passes (max; exps; their sum; the
gradient); the rows split over torch's OpenMP threads. Computed in fp32, as the loss's torch form does, but for the
sums: the exps are exp(x - max) <= 1, by a polynomial within 1.5 ulp of fp32's exp, summed in fp64 (in fp32, a lane
holding an exp near 1 drops the small ones added to it, which the torch form's cascade sums keep), and the other
ids' mass is summed without the target's term, so that 1 - p(target) stays exact as p(target) -> 1. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) (no NaN here) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float exp_nonpositive(float x) { /* exp(x) for x <= 0; 0 below -87 */
    const int underflow = x < -87.0f;
    x = underflow ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693145751953125f;                                    /* x - n ln 2, in two parts */
    r = r - n * 1.428606765330187e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n; a NaN x (a diverged step's logit) gives a NaN p, so the exp is NaN whatever scale is: n converted as 0
       then, since C leaves a NaN's conversion to an integer undefined */
    const int32_t bits = ((int32_t)(n == n ? n : 0.0f) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return underflow ? 0.0f : p * scale;
}

/* One row: x (vocab values, bf16 or fp32 by the caller's loads), exps (vocab fp32 scratch); returns the loss and
   writes the gradient through store. */
#define ROW(LOAD, STORE)                                                                                             \
    float max = -INFINITY;                                                                                           \
    _Pragma("omp simd reduction(max : max)") for (int64_t j = 0; j < vocab; j++) {                                  \
        const float x = LOAD(row[j]);                                                                                \
        max = x > max ? x : max;                                                                                     \
    }                                                                                                                \
    const int64_t t = target[i];                                                                                     \
    const float target_logit = LOAD(row[t]);                                                                         \
    _Pragma("omp simd") for (int64_t j = 0; j < vocab; j++) exps[j] = exp_nonpositive(LOAD(row[j]) - max);         \
    double sum = 0.0;                                                                                                \
    _Pragma("omp simd reduction(+ : sum)") for (int64_t j = 0; j < vocab; j++) sum += exps[j];                      \
    const float exp_target = exps[t];                                                                                \
    double other_sum = sum - exp_target;                                                                             \
    if (target_logit == max) { /* the target may hold most of the mass: sum the others alone */                     \
        exps[t] = 0.0f;                                                                                              \
        other_sum = 0.0;                                                                                             \
        _Pragma("omp simd reduction(+ : other_sum)") for (int64_t j = 0; j < vocab; j++) other_sum += exps[j];      \
    }                                                                                                                \
    const float other = (float)other_sum;                                                                            \
    sum = other_sum + exp_target;                                                                                    \
    /* -log p(target): log1p keeps its precision near 0; the log-sum-exp form where the target's exp underflows */   \
    loss[i] = exp_target > 0.5f ? log1pf(other / exp_target) : max + logf((float)sum) - target_logit;              \
    if (!write_grad) continue;                                                                                       \
    const float inv = scale[i] / (float)sum;                                                                         \
    _Pragma("omp simd") for (int64_t j = 0; j < vocab; j++) row[j] = STORE(exps[j] * inv);                          \
    row[t] = STORE(-other * inv);

#define IDENTITY(x) (x)

#define KERNEL(NAME, TYPE, LOAD, STORE)                                                                              \
    int NAME(TYPE *logits, const int64_t *target, const float *scale, float *loss, int64_t rows, int64_t vocab,      \
             int write_grad) {                                                                                       \
        int failed = 0;                                                                                              \
        _Pragma("omp parallel") {                                                                                    \
            float *exps = malloc(vocab * sizeof(float));                                                             \
            if (!exps) {                                                                                             \
                _Pragma("omp atomic write") failed = 1;                                                              \
            }                                                                                                        \
            _Pragma("omp barrier");                                                                                  \
            if (!failed) {                                                                                           \
                _Pragma("omp for schedule(static)") for (int64_t i = 0; i < rows; i++) {                            \
                    TYPE *row = logits + i * vocab;                                                                  \
                    ROW(LOAD, STORE)                                                                                 \
                }                                                                                                    \
            }                                                                                                        \
            free(exps);                                                                                              \
        }                                                                                                            \
        return failed;                                                                                               \
    }

KERNEL(softmax_grad_bf16, uint16_t, from_bf16, to_bf16)
KERNEL(softmax_grad_fp32, float, IDENTITY, IDENTITY)

/* bfloat16 <-> float32 as torch converts: widening is exact, narrowing rounds to nearest even and keeps NaN a
 * NaN. Shared by the kernels that #include it. */
#ifndef CPLLM_BF16_H
#define CPLLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

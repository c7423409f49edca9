/* What a kernel of this package returns, shared by every C source and by cpllm/kernels/checks.py, which turns a
 * nonzero status into the Python error naming the offending value and its limit.
 *
 * The bounds a kernel checks are those of the indices it would otherwise follow into memory: pool slots, context
 * lengths, source rows. It checks them in the pass that already reads the indices and touches no memory through a
 * bad one, so a metadata bug raises instead of writing outside a pool.
 */
#ifndef CPLLM_KERNEL_STATUS_H
#define CPLLM_KERNEL_STATUS_H

#include <stdint.h>

enum {
    CPLLM_OK = 0,
    CPLLM_NO_MEMORY = -1,          /* a scratch buffer could not be allocated */
    CPLLM_TEAM_ABORTED = -2,       /* a decode team's barrier gave up (decode_team.h) */
    CPLLM_SLOT_OUT_OF_RANGE = -3,  /* a slot outside [0, num_slots) of the pool */
    CPLLM_LENGTH_OUT_OF_RANGE = -4,/* a context length outside [0, the slot table's width] */
    CPLLM_ROW_OUT_OF_RANGE = -5,   /* a source row outside [0, rows) */
    CPLLM_UNSUPPORTED_SHAPE = -6,  /* a shape the kernel does not take (a head size over its buffer) */
};

/* Some index of idx[0 .. n) lies outside [0, limit): one comparison per index, with no early exit, so the
 * loop vectorizes (the unsigned cast sends negatives above any limit). */
static inline int cpllm_any_outside(const int64_t *idx, int64_t n, int64_t limit) {
    int outside = 0;
#pragma omp simd reduction(| : outside)
    for (int64_t i = 0; i < n; i++) outside |= (uint64_t)idx[i] >= (uint64_t)limit;
    return outside;
}

#endif

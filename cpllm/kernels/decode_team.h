/* A decode team: the PCP ranks of one host running a decode step together through one shared mapping.
 *
 * Every member holds the same decode rows. Each linear layer's output columns are divided between the members
 * (each streams its share of the weights and writes its columns into a shared buffer), and each member attends its
 * rows to its part of the context (its KV shard, or its half of a replicated context) and leaves the partial output
 * with its log-sum-exp in a shared slot; a barrier then lets every member read the whole. cpllm/model/decode_team.py
 * maps the buffers and says where each lives.
 *
 * The barrier: each member publishes a sequence number (one int64 per member, a cache line apart) after its writes
 * and waits until every member has published it. x86 keeps stores in order (TSO), so a member that sees the number
 * sees the data; the release store and acquire loads keep the compiler from reordering around them. A wait spins
 * (peers in step arrive within microseconds), then yields the core between checks, then sleeps, and every CHECK_S
 * calls back into Python, which raises the group's timeout or notices a member process that has exited (returning
 * nonzero aborts the step). Spinning assumes every member has a core: cpllm/model/decode_team.py forms a team only
 * then.
 */
#ifndef CPLLM_DECODE_TEAM_H
#define CPLLM_DECODE_TEAM_H

#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "kernel_status.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { TEAM_FLAG_STRIDE = 8 }; /* int64s between two members' flags: one cache line each */

/* Returns nonzero to abort the wait (the Python side has recorded why). */
typedef int (*team_check_fn)(double waited_s);

typedef struct {
    int64_t *flags;            /* [size * TEAM_FLAG_STRIDE] in the mapping */
    float *qkv;                /* [max_batch, q|k|v width]: each member's columns of the projection */
    float *partials, *lses;    /* [max_batch, size, heads, head_dim], [max_batch, size, heads]: attention parts */
    float *hidden_part;        /* [max_batch, hidden]: o and down projections' columns */
    float *gate_up;            /* [max_batch, 2 * intermediate] */
    int64_t max_batch;
    int member, size;
    int64_t seq;               /* barriers passed so far (the same on every member) */
    team_check_fn check;
    /* A tensor-parallel team only (decode_layer_tp.h): */
    float *sums;               /* [2, size, max_batch, hidden]: each member's partial sums of o and down */
    float *q_group;            /* [max_batch, size, heads * head_dim]: each member's queries, for its DCP group */
    int dcp;                   /* consecutive members per DCP group (1: none) */
} team_spec;

static const double TEAM_SPIN_S = 50e-6, TEAM_YIELD_S = 0.02, TEAM_CHECK_S = 0.05;

static inline double team_seconds_since(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + 1e-9 * (double)(now.tv_nsec - start->tv_nsec);
}

static inline void team_pause(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

/* Wait for every member to reach this point. Returns 0, or CPLLM_TEAM_ABORTED when the Python check aborted
 * the wait. */
static int team_barrier(team_spec *T) {
    const int64_t seq = ++T->seq;
    __atomic_store_n(&T->flags[T->member * TEAM_FLAG_STRIDE], seq, __ATOMIC_RELEASE);
    for (int r = 0; r < T->size; r++) {
        const int64_t *flag = &T->flags[r * TEAM_FLAG_STRIDE];
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) continue;
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        double next_check = TEAM_CHECK_S;
        for (uint64_t spins = 1; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; spins++) {
            team_pause();
            if (spins % 64) continue;
            const double waited = team_seconds_since(&start);
            if (waited > TEAM_YIELD_S) {
                const struct timespec nap = {0, 200000};
                nanosleep(&nap, NULL);
            } else if (waited > TEAM_SPIN_S) {
                sched_yield();
            }
            if (waited > next_check) {
                if (T->check && T->check(waited)) return CPLLM_TEAM_ABORTED;
                next_check = waited + TEAM_CHECK_S;
            }
        }
    }
    return 0;
}

/* [first, end) of n columns for this member: whole units of 16 columns, as evenly as they go. */
static inline void team_columns(const team_spec *T, int64_t n, int64_t *first, int64_t *end) {
    const int64_t units = (n + 15) / 16;
    *first = 16 * (units * T->member / T->size);
    const int64_t stop = 16 * (units * (T->member + 1) / T->size);
    *end = stop < n ? stop : n;
}

/* Exported for the tests: one barrier on its own. */
int cpllm_team_barrier(team_spec *T) { return team_barrier(T); }

#endif

/* One decoder layer of a decode step in one call: the eager layer's own kernels, run back to back from C.
 *
 * For a Llama-family layer whose four linears each run as one kernel (int4 groups packed for the VNNI kernel, or a
 * float32 weight in f32_matmul.c's matrix-vector loop), on a rank that holds its requests' whole context
 * (cpllm/model/fused_decode.py decides): RMSNorm, q|k|v projection, rotary embedding of q and k, the new K/V
 * stored into the pools, decode attention read in place from the pools, output projection and residual,
 * RMSNorm, gate|up projection, silu(gate) * up, down projection and residual. Each step is the same C
 * function the eager path calls on the CPU (included below) and the residual adds round as torch's, so with int4
 * weights the results are the eager layer's, bit for bit; float32 weights sum in another order than MKL's
 * matrix product (within float32 rounding). What this removes is the Python and dispatcher cost around some twenty
 * operator calls per layer: most of a batch-1 step's time once the weights stream at memory speed.
 *
 * With a team (decode_team.h: the PCP ranks of one host), the members run the layer together: each computes its
 * share of every linear's output columns into the shared buffers and its part of the attention, five barriers
 * per layer; the rest (norms, rotary, residuals, the merge of the attention parts) every member computes alike on
 * the whole rows, so every member ends the layer with the same hidden state. A column's value does not depend on
 * which member computes it, so the linears give the solo layer's bits; only the attention's split into parts
 * rounds differently (merged exactly by log-sum-exp).
 *
 * The TP ranks of one host (PCP = 1), each holding its weight shards, run cpllm_decode_layer_tp instead
 * (decode_layer_tp.h): their partial sums and, with DCP, their attention parts meet in the same kind of shared
 * buffers.
 */
#include <stddef.h>

#include "decode_attention.c"
#include "decode_rows.c"
#include "decode_team.h"
#include "f32_matmul.c"
#include "int4_matmul.c"
#include "kernel_status.h"
#include "rms_norm.c"

enum { LINEAR_INT4 = 0, LINEAR_F32 = 1 };

/* A linear layer's weight: int4 groups packed as int4_matmul.c lays them out, or float32 [in, out]. */
typedef struct {
    const void *weight;
    int kind;
} linear_spec;

/* The layer's weights and shapes. */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    linear_spec qkv, o, gate_up, down;
    int hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
} layer_spec;

/* The step's decode batch: rotary tables, the K/V writes, and each request's context slots (this member's part of
 * them in a team). */
typedef struct {
    int64_t batch;
    const float *cos, *sin;                   /* [batch, head_dim] */
    const int64_t *write_rows, *write_slots;  /* [writes] */
    int64_t writes;
    const int64_t *slots, *lengths;           /* [batch, slot_stride], [batch] */
    int64_t slot_stride;
    int pool_dtype, chunk, threads;
    int64_t num_slots;                        /* rows of each K/V pool: every slot is checked against it */
} step_spec;

/* The new K and V of rows [B, width] (k at kv, v at kv + kv_width) into their pool slots; each store checks its
 * indices before it writes. */
static int store_kv(const step_spec *S, const float *kv, int64_t width, int64_t kv_width, void *k_pool,
                    void *v_pool) {
    const int status = cpllm_store_rows(kv, width, S->batch, S->write_rows, S->write_slots, S->writes, kv_width,
                                        k_pool, S->num_slots, S->pool_dtype);
    if (status != CPLLM_OK) return status;
    return cpllm_store_rows(kv + kv_width, width, S->batch, S->write_rows, S->write_slots, S->writes, kv_width,
                            v_pool, S->num_slots, S->pool_dtype);
}

static void add_rows(float *restrict hidden, const float *restrict delta, int64_t n) {
    for (int64_t i = 0; i < n; i++) hidden[i] = hidden[i] + delta[i];
}

/* y [rows, out] = x W: all columns alone; in a team this member's columns into the shared `y`, then the barrier. */
static int linear(linear_spec w, const float *x, int64_t rows, int in, int out, float *y, int threads,
                  team_spec *T) {
    int64_t first = 0, end = out;
    if (T) team_columns(T, out, &first, &end);
    int status = w.kind == LINEAR_INT4
        ? cpllm_int4_matmul_blocks(x, rows, in, (const uint8_t *)w.weight, out, first / 16, (end + 15) / 16, y, out,
                                   threads)
        : cpllm_f32_matmul_cols(x, rows, in, (const float *)w.weight, out, first, end, y, out, threads);
    if (T && team_barrier(T)) return CPLLM_TEAM_ABORTED;
    return status;
}

/* Attention of q [B, Hq, D] to the pools; in a team, this member's part goes to the shared slots and, after the
 * barrier, every member merges all parts of each row (log-sum-exp weights) into out. */
static int attention(const layer_spec *L, const step_spec *S, const float *q, const void *k_pool, const void *v_pool,
                     float *out, float *lse, team_spec *T) {
    const int64_t B = S->batch;
    const int hq = L->heads, d = L->head_dim;
    int status = cpllm_paged_decode_attention(q, k_pool, v_pool, S->pool_dtype, S->num_slots, S->slots,
                                              S->slot_stride, S->lengths, B, hq, L->kv_heads, d, L->scale, S->chunk,
                                              S->threads, out, lse);
    if (!T) return status;
    const int P = T->size;
    for (int64_t b = 0; b < B; b++) {
        memcpy(T->partials + ((size_t)b * P + T->member) * hq * d, out + (size_t)b * hq * d, sizeof(float) * hq * d);
        memcpy(T->lses + ((size_t)b * P + T->member) * hq, lse + (size_t)b * hq, sizeof(float) * hq);
    }
    if (team_barrier(T)) return CPLLM_TEAM_ABORTED;
    for (int64_t b = 0; b < B; b++)
        merge_partials(T->partials + (size_t)b * P * hq * d, T->lses + (size_t)b * P * hq, P, hq, d,
                       out + (size_t)b * hq * d, lse + (size_t)b * hq);
    return status;
}

/* hidden [batch, hidden] float32, updated in place; `team` NULL for a rank alone. Returns 0; CPLLM_TEAM_ABORTED when
 * a barrier's check gave up (a member died or the wait timed out); else the first other error of a kernel
 * (kernel_status.h: no memory, an index out of range). A kernel that refuses its indices touches no memory through
 * them and the layer goes on to the end, so a team's other members are not left waiting at a barrier. */
int cpllm_decode_layer(float *hidden, const layer_spec *L, const step_spec *S, void *k_pool, void *v_pool,
                       team_spec *T) {
    const int64_t B = S->batch;
    const int H = L->hidden, qd = L->heads * L->head_dim, kvd = L->kv_heads * L->head_dim;
    const int qkv_width = qd + 2 * kvd, I = L->intermediate;
    const size_t floats = (size_t)B * (2 * H + qkv_width + 2 * qd + L->heads + 3 * I);
    float *work = malloc(sizeof(float) * floats);
    if (!work) return CPLLM_NO_MEMORY;
    float *normed = work, *qkv = normed + B * H, *q = qkv + B * qkv_width, *attn = q + B * qd;
    float *lse = attn + B * qd, *proj = lse + B * L->heads, *gate_up = proj + B * H;
    float *act = gate_up + B * 2 * I;
    float *qkv_out = T ? T->qkv : qkv, *proj_out = T ? T->hidden_part : proj, *gate_up_out = T ? T->gate_up : gate_up;
    int status = 0;
#define STEP(call) do { const int s_ = (call); if (s_ == CPLLM_TEAM_ABORTED) { free(work); return s_; } \
                             if (status == CPLLM_OK) status = s_; } while (0)

    cpllm_rms_norm(hidden, L->input_norm, L->eps, B, H, 1, H, normed, S->threads);
    STEP(linear(L->qkv, normed, B, H, qkv_width, qkv_out, S->threads, T));
    if (T) memcpy(qkv, qkv_out, sizeof(float) * B * qkv_width); /* rotary works in place: on this member's copy */
    STEP(cpllm_rope_qk(qkv, L->heads, qkv_width, qkv + qd, L->kv_heads, qkv_width, B, L->head_dim, S->cos, S->sin));
    STEP(store_kv(S, qkv + qd, qkv_width, kvd, k_pool, v_pool));
    for (int64_t b = 0; b < B; b++) memcpy(q + b * qd, qkv + b * qkv_width, sizeof(float) * qd);
    STEP(attention(L, S, q, k_pool, v_pool, attn, lse, T));
    STEP(linear(L->o, attn, B, qd, H, proj_out, S->threads, T));
    add_rows(hidden, proj_out, B * H);

    cpllm_rms_norm(hidden, L->post_norm, L->eps, B, H, 1, H, normed, S->threads);
    STEP(linear(L->gate_up, normed, B, H, 2 * I, gate_up_out, S->threads, T));
    cpllm_silu_mul(gate_up_out, B, I, act, S->threads);
    STEP(linear(L->down, act, B, I, H, proj_out, S->threads, T));
    add_rows(hidden, proj_out, B * H);
#undef STEP
    free(work);
    return status;
}

#include "decode_layer_tp.h"

/* Each struct above as the compiler laid it out, for the ctypes copies of cpllm/kernels/structs.py to be checked
 * against when the library loads: a struct's size (field NULL), a field's offset, or -1 for a name not listed. */
typedef struct {
    const char *type, *field;
    int64_t value;
} layout_entry;

#define SIZE_OF(T) {#T, NULL, (int64_t)sizeof(T)}
#define FIELD_OF(T, F) {#T, #F, (int64_t)offsetof(T, F)}
static const layout_entry LAYOUT[] = {
    SIZE_OF(linear_spec), FIELD_OF(linear_spec, weight), FIELD_OF(linear_spec, kind),
    SIZE_OF(layer_spec), FIELD_OF(layer_spec, input_norm), FIELD_OF(layer_spec, post_norm),
    FIELD_OF(layer_spec, qkv), FIELD_OF(layer_spec, o), FIELD_OF(layer_spec, gate_up), FIELD_OF(layer_spec, down),
    FIELD_OF(layer_spec, hidden), FIELD_OF(layer_spec, heads), FIELD_OF(layer_spec, kv_heads),
    FIELD_OF(layer_spec, head_dim), FIELD_OF(layer_spec, intermediate), FIELD_OF(layer_spec, eps),
    FIELD_OF(layer_spec, scale),
    SIZE_OF(step_spec), FIELD_OF(step_spec, batch), FIELD_OF(step_spec, cos), FIELD_OF(step_spec, sin),
    FIELD_OF(step_spec, write_rows), FIELD_OF(step_spec, write_slots), FIELD_OF(step_spec, writes),
    FIELD_OF(step_spec, slots), FIELD_OF(step_spec, lengths), FIELD_OF(step_spec, slot_stride),
    FIELD_OF(step_spec, pool_dtype), FIELD_OF(step_spec, chunk), FIELD_OF(step_spec, threads),
    FIELD_OF(step_spec, num_slots),
    SIZE_OF(team_spec), FIELD_OF(team_spec, flags), FIELD_OF(team_spec, qkv), FIELD_OF(team_spec, partials),
    FIELD_OF(team_spec, lses), FIELD_OF(team_spec, hidden_part), FIELD_OF(team_spec, gate_up),
    FIELD_OF(team_spec, max_batch), FIELD_OF(team_spec, member), FIELD_OF(team_spec, size),
    FIELD_OF(team_spec, seq), FIELD_OF(team_spec, check), FIELD_OF(team_spec, sums), FIELD_OF(team_spec, q_group),
    FIELD_OF(team_spec, dcp),
};
#undef SIZE_OF
#undef FIELD_OF

int64_t cpllm_struct_layout(const char *type, const char *field) {
    for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++) {
        const layout_entry *e = &LAYOUT[i];
        if (strcmp(e->type, type) == 0 && (field == NULL ? e->field == NULL : e->field && !strcmp(e->field, field)))
            return e->value;
    }
    return -1;
}

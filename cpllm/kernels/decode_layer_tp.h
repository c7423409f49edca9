/* One decoder layer of a decode step on a tensor-parallel team: the TP ranks of one host (PCP = 1), each holding
 * its shard of the weights, run the layer through the shared buffers of decode_team.h instead of collectives.
 *
 * Each member projects q|k|v for its own heads and gate|up for its own intermediate columns (its weight shards
 * are exactly those columns), stores its new K/V where the step says (its DCP shard), and attends:
 * - DCP = 1: its heads to its whole context, alone;
 * - DCP > 1: the DCP group's ranks (consecutive members) hold the same KV heads and each a shard of the context.
 *   Each publishes its queries; each attends every query head of its group to its own shard and publishes the
 *   partial output with its log-sum-exp; each then merges its own heads' parts exactly (docs/context_parallel.md, "Exact merge").
 * The output and down projections' shards each give a partial sum over all hidden columns: every member publishes
 * its part and adds all parts in member order, so every member ends the layer with the same hidden state (the
 * all-reduce of the eager layers). Barriers per layer: two, plus two with DCP > 1.
 *
 * The partial-sum slots alternate between the two projections: a member can only write a slot again after a
 * later barrier that every member passes once it has read that slot.
 */
#ifndef CPLLM_DECODE_LAYER_TP_H
#define CPLLM_DECODE_LAYER_TP_H

/* Publish this member's partial sum [B, H], wait for the others, add every member's part to hidden in member
 * order (the same order on each member: the same result everywhere). */
static int tp_add_sum(team_spec *T, int which, const float *part, int64_t B, int H, float *hidden, float *sum) {
    const size_t n = (size_t)B * H, stride = (size_t)T->max_batch * H;
    float *slots = T->sums + (size_t)which * T->size * stride;
    memcpy(slots + T->member * stride, part, sizeof(float) * n);
    if (team_barrier(T)) return CPLLM_TEAM_ABORTED;
    memcpy(sum, slots, sizeof(float) * n);
    for (int m = 1; m < T->size; m++) add_rows(sum, slots + m * stride, (int64_t)n);
    add_rows(hidden, sum, (int64_t)n);
    return 0;
}

/* Attention of this member's query heads q [B, hq, D] to its context (DCP = 1), or, with DCP > 1, to the whole
 * context of its group (every member's shard, merged). `work` holds [B, dcp * hq, D] queries, outputs and lses. */
static int tp_attention(const layer_spec *L, const step_spec *S, const float *q, const void *k_pool,
                        const void *v_pool, float *out, float *lse, float *work, team_spec *T) {
    const int64_t B = S->batch;
    const int hq = L->heads, d = L->head_dim, dcp = T->dcp;
    if (dcp == 1)
        return cpllm_paged_decode_attention(q, k_pool, v_pool, S->pool_dtype, S->num_slots, S->slots,
                                            S->slot_stride, S->lengths, B, hq, L->kv_heads, d, L->scale, S->chunk,
                                            S->threads, out, lse);
    const int ghq = dcp * hq, first = T->member - T->member % dcp, mine = T->member % dcp;
    const size_t qd = (size_t)hq * d;
    for (int64_t b = 0; b < B; b++) memcpy(T->q_group + ((size_t)b * T->size + T->member) * qd, q + b * qd,
                                           sizeof(float) * qd);
    if (team_barrier(T)) return CPLLM_TEAM_ABORTED;
    float *gq = work, *gout = gq + (size_t)B * ghq * d, *glse = gout + (size_t)B * ghq * d;
    for (int64_t b = 0; b < B; b++)  /* the group's members' heads in member order: the eager all-gather's order */
        memcpy(gq + (size_t)b * ghq * d, T->q_group + ((size_t)b * T->size + first) * qd, sizeof(float) * dcp * qd);
    const int status = cpllm_paged_decode_attention(gq, k_pool, v_pool, S->pool_dtype, S->num_slots, S->slots,
                                                    S->slot_stride, S->lengths, B, ghq, L->kv_heads, d, L->scale,
                                                    S->chunk, S->threads, gout, glse);
    const size_t part = (size_t)ghq * d;
    for (int64_t b = 0; b < B; b++) {
        memcpy(T->partials + ((size_t)b * T->size + T->member) * part, gout + b * part, sizeof(float) * part);
        memcpy(T->lses + ((size_t)b * T->size + T->member) * ghq, glse + b * ghq, sizeof(float) * ghq);
    }
    if (team_barrier(T)) return CPLLM_TEAM_ABORTED;
    for (int64_t b = 0; b < B; b++) {  /* this member's heads from each group member's part, then merged */
        for (int p = 0; p < dcp; p++) {
            const size_t src = (size_t)b * T->size + first + p;
            memcpy(gout + p * qd, T->partials + src * part + mine * qd, sizeof(float) * qd);
            memcpy(glse + p * hq, T->lses + src * ghq + mine * hq, sizeof(float) * hq);
        }
        merge_partials(gout, glse, dcp, hq, d, out + b * qd, lse + b * hq);
    }
    return status;
}

/* hidden [batch, hidden] float32, updated in place; L holds this member's shards (its heads, KV heads and
 * intermediate columns). Returns what cpllm_decode_layer returns. */
int cpllm_decode_layer_tp(float *hidden, const layer_spec *L, const step_spec *S, void *k_pool, void *v_pool,
                          team_spec *T) {
    const int64_t B = S->batch;
    const int H = L->hidden, qd = L->heads * L->head_dim, kvd = L->kv_heads * L->head_dim;
    const int qkv_width = qd + 2 * kvd, I = L->intermediate, ghq = T->dcp * L->heads;
    const size_t group = (size_t)B * ghq * (2 * L->head_dim + 1);
    const size_t floats = (size_t)B * (3 * H + qkv_width + 2 * qd + L->heads + 3 * I) + group;
    float *work = malloc(sizeof(float) * floats);
    if (!work) return CPLLM_NO_MEMORY;
    float *normed = work, *qkv = normed + B * H, *q = qkv + B * qkv_width, *attn = q + B * qd;
    float *lse = attn + B * qd, *proj = lse + B * L->heads, *sum = proj + B * H, *gate_up = sum + B * H;
    float *act = gate_up + B * 2 * I, *group_work = act + B * I;
    int status = 0;
#define STEP(call) do { const int s_ = (call); if (s_ == CPLLM_TEAM_ABORTED) { free(work); return s_; } \
                             if (status == CPLLM_OK) status = s_; } while (0)

    cpllm_rms_norm(hidden, L->input_norm, L->eps, B, H, 1, H, normed, S->threads);
    STEP(linear(L->qkv, normed, B, H, qkv_width, qkv, S->threads, NULL));
    STEP(cpllm_rope_qk(qkv, L->heads, qkv_width, qkv + qd, L->kv_heads, qkv_width, B, L->head_dim, S->cos, S->sin));
    STEP(store_kv(S, qkv + qd, qkv_width, kvd, k_pool, v_pool));
    for (int64_t b = 0; b < B; b++) memcpy(q + b * qd, qkv + b * qkv_width, sizeof(float) * qd);
    STEP(tp_attention(L, S, q, k_pool, v_pool, attn, lse, group_work, T));
    STEP(linear(L->o, attn, B, qd, H, proj, S->threads, NULL));
    STEP(tp_add_sum(T, 0, proj, B, H, hidden, sum));

    cpllm_rms_norm(hidden, L->post_norm, L->eps, B, H, 1, H, normed, S->threads);
    STEP(linear(L->gate_up, normed, B, H, 2 * I, gate_up, S->threads, NULL));
    cpllm_silu_mul(gate_up, B, I, act, S->threads);
    STEP(linear(L->down, act, B, I, H, proj, S->threads, NULL));
    STEP(tp_add_sum(T, 1, proj, B, H, hidden, sum));
#undef STEP
    free(work);
    return status;
}

#endif

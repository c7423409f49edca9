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
 */
#include "decode_attention.c"
#include "decode_rows.c"
#include "f32_matmul.c"
#include "int4_matmul.c"
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

/* The step's decode batch: rotary tables, the K/V writes, and each request's context slots. */
typedef struct {
    int64_t batch;
    const float *cos, *sin;                   /* [batch, head_dim] */
    const int64_t *write_rows, *write_slots;  /* [writes] */
    int64_t writes;
    const int64_t *slots, *lengths;           /* [batch, slot_stride], [batch] */
    int64_t slot_stride;
    int pool_dtype, chunk, threads;
} step_spec;

static void add_rows(float *restrict hidden, const float *restrict delta, int64_t n) {
    for (int64_t i = 0; i < n; i++) hidden[i] = hidden[i] + delta[i];
}

static int linear(linear_spec w, const float *x, int64_t rows, int in, int out, float *y, int threads) {
    if (w.kind == LINEAR_INT4) return cpllm_int4_matmul(x, rows, in, (const uint8_t *)w.weight, out, y, threads);
    return cpllm_f32_matmul(x, rows, in, (const float *)w.weight, out, y, threads);
}

/* hidden [batch, hidden] float32, updated in place. Returns 0, or -1 when a kernel could not allocate. */
int cpllm_decode_layer(float *hidden, const layer_spec *L, const step_spec *S, void *k_pool, void *v_pool) {
    const int64_t B = S->batch;
    const int H = L->hidden, qd = L->heads * L->head_dim, kvd = L->kv_heads * L->head_dim;
    const int qkv_width = qd + 2 * kvd;
    const size_t floats = (size_t)B * (2 * H + qkv_width + 2 * qd + L->heads + 3 * L->intermediate);
    float *work = malloc(sizeof(float) * floats);
    if (!work) return -1;
    float *normed = work, *qkv = normed + B * H, *q = qkv + B * qkv_width, *attn = q + B * qd;
    float *lse = attn + B * qd, *proj = lse + B * L->heads, *gate_up = proj + B * H;
    float *act = gate_up + B * 2 * L->intermediate;
    int status = 0;

    cpllm_rms_norm(hidden, L->input_norm, L->eps, B, H, normed, S->threads);
    status |= linear(L->qkv, normed, B, H, qkv_width, qkv, S->threads);
    status |= cpllm_rope_qk(qkv, L->heads, qkv_width, qkv + qd, L->kv_heads, qkv_width, B, L->head_dim, S->cos, S->sin);
    cpllm_store_rows(qkv + qd, qkv_width, S->write_rows, S->write_slots, S->writes, kvd, k_pool, S->pool_dtype);
    cpllm_store_rows(qkv + qd + kvd, qkv_width, S->write_rows, S->write_slots, S->writes, kvd, v_pool, S->pool_dtype);
    for (int64_t b = 0; b < B; b++) memcpy(q + b * qd, qkv + b * qkv_width, sizeof(float) * qd);
    status |= cpllm_paged_decode_attention(q, k_pool, v_pool, S->pool_dtype, S->slots, S->slot_stride, S->lengths, B,
                                           L->heads, L->kv_heads, L->head_dim, L->scale, S->chunk, S->threads,
                                           attn, lse);
    status |= linear(L->o, attn, B, qd, H, proj, S->threads);
    add_rows(hidden, proj, B * H);

    cpllm_rms_norm(hidden, L->post_norm, L->eps, B, H, normed, S->threads);
    status |= linear(L->gate_up, normed, B, H, 2 * L->intermediate, gate_up, S->threads);
    cpllm_silu_mul(gate_up, B, L->intermediate, act, S->threads);
    status |= linear(L->down, act, B, L->intermediate, H, proj, S->threads);
    add_rows(hidden, proj, B * H);
    free(work);
    return status ? -1 : 0;
}

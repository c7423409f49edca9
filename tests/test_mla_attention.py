"""Multi-head latent attention (cpllm/layers/mla/attention.py, backend.py) on one rank against
transformers' DeepseekV2Attention, DeepseekV3Attention and Glm4MoeLiteAttention on the same random weights.

Two requests run through the CP layer with the MLA backend over one latent pool, in four steps as the scheduler
would lay them out: a 9-token prompt chunk; its 5-token continuation (reading the cached latents) beside a fresh
6-token prompt; then two decode steps of both. Every row must equal transformers' layer run on each whole
sequence with a causal mask, and the pool must hold each token's latent (normed compressed KV | rotated k_pe, in
cpllm's rotary layout) and nothing else. The expanded form must agree with the absorbed one to float32 rounding.

Shapes: hidden 64, 4 heads, kv_lora_rank 32, rope 16, nope 16, v_head_dim 24 (v differs from nope + rope).
"""

from __future__ import annotations

import math

import pytest
import torch

from cpllm.config.deepseek import MLAConfig
from cpllm.config.rope import resolve_rope_scaling
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.layers.mla.backend import MLAPagedBackend, latent_pool
from cpllm.context_parallel.plan import StepPath
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.layers.mla.attention import MLAAttention
from cpllm.model.rope import RotaryEmbedding
from cpllm.step import ScheduledChunk
from step_plans import eager_plan
from test_deepseek_moe import ARCH, DictSource

PREFIX = "model.layers.0.self_attn"
HIDDEN, HEADS, BLOCK, MAX_POS = 64, 4, 4, 64
SHAPES = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
LENGTHS = {"a": 16, "b": 8}
"""Tokens of each request by the end: a = 9 + 5 + 2 decodes, b = 6 + 2 decodes."""
STEPS = [
    [("a", 0, 9)],
    [("a", 9, 5), ("b", 0, 6)],
    [("a", 14, 1), ("b", 6, 1)],
    [("a", 15, 1), ("b", 7, 1)],
]
"""(request, start, new tokens) of each chunk of each step."""
BLOCKS = {"a": tuple(range(1, 9)), "b": tuple(range(9, 17))}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.9,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
CASES = {
    "v2": ("v2", dict(q_lora_rank=None)),
    "v2-q-lora": ("v2", dict(q_lora_rank=24)),
    "v3-interleave": ("v3", dict(q_lora_rank=24, rope_interleave=True)),
    "v3-halves": ("v3", dict(q_lora_rank=None, rope_interleave=False)),
    "v3-yarn": ("v3", dict(q_lora_rank=24, rope_interleave=True, rope_parameters={**YARN, "rope_theta": 10000.0})),
    "glm": ("glm", dict(q_lora_rank=24)),
}
ATOL = 2e-5


def hf_config(family: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    fields = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS, max_position_embeddings=MAX_POS, **SHAPES)
    fields.update(overrides)
    classes = {"v2": DeepseekV2Config, "v3": DeepseekV3Config, "glm": Glm4MoeLiteConfig}
    config = classes[family](**fields)
    config._attn_implementation = "eager"
    return config


def hf_attention(family: str, config, seed: int):
    """transformers' attention layer and its rotary embedding, weights from a seeded generator."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm

    module = {"v2": v2, "v3": v3, "glm": glm}[family]
    prefix = {"v2": "DeepseekV2", "v3": "DeepseekV3", "glm": "Glm4MoeLite"}[family]
    attention = getattr(module, f"{prefix}Attention")(config, layer_idx=0).eval()
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in attention.state_dict(keep_vars=True).items():
            if name.endswith("layernorm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=gen))
            else:  # large enough that each query's attention is peaked: a wrong key or position shows
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
    return attention, rotary


def hf_outputs(family: str, attention, rotary, x: torch.Tensor) -> torch.Tensor:
    # x [L, hidden] -> transformers' layer output [L, hidden] over the whole causal sequence
    length = x.shape[0]
    positions = torch.arange(length).unsqueeze(0)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        embeddings = rotary(x.unsqueeze(0), positions)
        out, _ = attention(hidden_states=x.unsqueeze(0), attention_mask=mask, position_embeddings=embeddings)
    return out[0]


def ours(family: str, config, attention, parallel: ParallelContext = ParallelContext()
         ) -> tuple[MLAAttention, RotaryEmbedding]:
    cfg = {**config.to_dict(), "architectures": [ARCH[family]]}
    mla = MLAConfig.from_hf_config(cfg)
    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    scaling = resolve_rope_scaling(params, MAX_POS) if params.get("rope_type", "default") != "default" else None
    layer = MLAAttention(mla, HIDDEN, HEADS, mla.softmax_scale(scaling), PREFIX, parallel, torch.float32)
    source = DictSource({f"{PREFIX}.{name}": t.detach().clone() for name, t in attention.state_dict().items()})
    for module in layer.modules():
        if hasattr(module, "load"):
            module.load(source)
    return layer, RotaryEmbedding(mla.qk_rope_head_dim, theta, scaling, MAX_POS)


def inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + seed)
    return {name: torch.randn(length, HIDDEN, generator=gen) for name, length in LENGTHS.items()}


def run_steps(layer: MLAAttention, rope: RotaryEmbedding, x: dict, decode_plan: StepPath | None):
    """The four steps through the CP layer; returns ({request: output rows [L, hidden]}, pool)."""
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    pool = latent_pool(20 * BLOCK, layer.mla.kv_lora_rank, layer.mla.qk_rope_head_dim, torch.float32)
    pool.fill_(float("nan"))  # a slot read before it is written poisons the output
    got = {name: torch.full((length, HIDDEN), float("nan")) for name, length in LENGTHS.items()}
    for step in STEPS:
        chunks = [ScheduledChunk(request_id=name, token_ids=tuple([1] * new), start_pos=start,
                                 block_table=BLOCKS[name], sample=True, prompt_logits=False)
                  for name, start, new in step]
        batch = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout, path=decode_plan))
        hidden = torch.cat([x[name][start:start + new] for name, start, new in step])
        assert batch.attention.num_rows == hidden.shape[0]
        assert batch.positions.tolist() == [p for _, start, new in step for p in range(start, start + new)]
        with torch.no_grad():
            out = layer(hidden, rope.tables(batch.positions, torch.float32), (pool, pool), batch.attention)
        row = 0
        for name, start, new in step:
            got[name][start:start + new] = out[row:row + new]
            row += new
    return got, pool


@pytest.mark.parametrize("expanded_prefill", [True, False], ids=["expanded-prefill", "absorbed-prefill"])
@pytest.mark.parametrize("decode_plan", [None, StepPath.GATHERED_DECODE], ids=["one-shard", "partials"])
@pytest.mark.parametrize("name", list(CASES))
def test_absorbed_steps_match_transformers(name, decode_plan, expanded_prefill, monkeypatch):
    """Decode absorbed; prefill chunks expanded (new tokens) + absorbed (cached context), or wholly absorbed."""
    seed = list(CASES).index(name)
    family, overrides = CASES[name]
    config = hf_config(family, **overrides)
    attention, rotary = hf_attention(family, config, seed)
    layer, rope = ours(family, config, attention)
    layer.expanded_prefill = expanded_prefill
    expansions = []
    expand = layer.expand
    monkeypatch.setattr(layer, "expand", lambda latent: expansions.append(latent.shape[0]) or expand(latent))
    x = inputs(seed)
    got, pool = run_steps(layer, rope, x, decode_plan)
    # the expanded form runs on the prompt chunks' new tokens only (9, then 5 + 6), never on a decode or the cache
    assert expansions == ([9, 11] if expanded_prefill else [])
    for request, rows in got.items():
        want = hf_outputs(family, attention, rotary, x[request])
        diff = (rows - want).abs().max().item()
        assert diff <= ATOL, f"{name} request {request}: {diff:.3g}"
        assert want.abs().max().item() > 0.5
    # the pool: each token's latent at its slot, nothing anywhere else
    written = torch.zeros(pool.shape[0], dtype=torch.bool)
    for request, length in LENGTHS.items():
        slots = slots_of(request, range(length))
        with torch.no_grad():
            _, _, c, k_pe = layer._project(x[request], rope.tables(torch.arange(length), torch.float32))
        torch.testing.assert_close(pool[slots, 0], torch.cat((c, k_pe[:, 0]), dim=-1), rtol=1e-6, atol=1e-5)
        written[slots] = True
    assert torch.isnan(pool[~written]).all()


def slots_of(request: str, positions) -> torch.Tensor:
    return torch.tensor([BLOCKS[request][p // BLOCK] * BLOCK + p % BLOCK for p in positions], dtype=torch.long)


def setup(name: str):
    seed = list(CASES).index(name)
    family, overrides = CASES[name]
    config = hf_config(family, **overrides)
    attention, rotary = hf_attention(family, config, seed)
    return family, attention, rotary, seed, config


@pytest.mark.parametrize("name", ["v2-q-lora", "v3-yarn", "glm"])
def test_expanded_form_matches_absorbed_and_transformers(name):
    """The reference's own form (every head's keys and values expanded from the latents), run on request a's
    chunks (9 fresh tokens, 5 more after them, two decodes): it stores the same latents, and its outputs agree
    with transformers and with the absorbed form to float32 rounding."""
    family, attention, rotary, seed, config = setup(name)
    layer, rope = ours(family, config, attention)
    x = inputs(seed)["a"]
    pool = latent_pool(20 * BLOCK, layer.mla.kv_lora_rank, layer.mla.qk_rope_head_dim, torch.float32)
    expanded = torch.empty(LENGTHS["a"], HIDDEN)
    for start, new in [(0, 9), (9, 5), (14, 1), (15, 1)]:
        positions = torch.arange(start, start + new)
        with torch.no_grad():
            expanded[positions] = layer.forward_expanded(x[positions], rope.tables(positions, torch.float32), pool,
                                                         slots_of("a", positions), slots_of("a", range(start)))
    absorbed, absorbed_pool = run_steps(layer, rope, inputs(seed), None)
    assert (expanded - hf_outputs(family, attention, rotary, x)).abs().max().item() <= ATOL
    assert (expanded - absorbed["a"]).abs().max().item() <= ATOL
    slots = slots_of("a", range(LENGTHS["a"]))
    torch.testing.assert_close(pool[slots], absorbed_pool[slots], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ["v2", "v3-yarn"])
def test_tp_ranks_heads_sum_to_single_rank(name):
    """TP=2: each rank holds 2 of the 4 heads (q, kv_b_proj rows, o_proj columns) and the whole latent; the ranks'
    partial outputs (o_proj before its all-reduce) sum to the single rank's."""
    family, attention, _, seed, config = setup(name)
    single, rope = ours(family, config, attention)
    want, want_pool = run_steps(single, rope, inputs(seed), None)
    parts = []
    for rank in range(2):
        layer, _ = ours(family, config, attention, ParallelContext.at(ParallelDims(tp=2), tp_rank=rank))
        assert layer.heads == 2 and layer.kv_b.shape[0] == 2
        got, pool = run_steps(layer, rope, inputs(seed), None)
        torch.testing.assert_close(pool, want_pool, rtol=0, atol=0, equal_nan=True)  # the latent is replicated
        parts.append(got)
    for request in LENGTHS:
        assert (parts[0][request] + parts[1][request] - want[request]).abs().max().item() <= ATOL


def test_mla_backend_has_the_whole_interface_and_narrow_values():
    """Every AttentionBackend method; `attend` with values narrower than the keys equals attention computed with
    the values padded by hand, and a single latent pool is written once per row."""
    backend = MLAPagedBackend()
    methods = [m for m in AttentionBackend.__dict__ if not m.startswith("_")]
    assert all(hasattr(backend, m) for m in methods) and backend.name == "mla"
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 32, generator=gen), torch.randn(7, 4, 32, generator=gen)
    v = torch.randn(7, 4, 24, generator=gen)
    out, lse = backend.attend(q, k, v, 0.3, False)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert out.shape == (5, 4, 24)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1).t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="wider than the keys"):
        backend.attend(q, k[..., :16], torch.randn(7, 4, 24), 0.3, False)
    pool = latent_pool(8, 6, 2, torch.float32)
    rows = torch.randn(3, 1, 8, generator=gen)
    backend.store_kv(pool, pool, torch.tensor([5, 1, 2]), rows, rows, torch.tensor([2, 0, 1]))
    assert torch.equal(pool[torch.tensor([5, 1, 2])], rows[torch.tensor([2, 0, 1])])


def test_softmax_scale_yarn_mscale():
    mla = MLAConfig(**SHAPES)
    assert mla.softmax_scale(None) == 32**-0.5 and mla.latent_width == 48 and mla.qk_head_dim == 32
    m = 0.1 * 0.7 * math.log(4.0) + 1.0
    assert mla.softmax_scale(YARN) == pytest.approx(32**-0.5 * m * m, rel=1e-12)
    with pytest.raises(ValueError, match="qk_rope_head_dim=15 must be even"):
        MLAConfig(**{**SHAPES, "qk_rope_head_dim": 15})


@pytest.mark.parametrize("plan", [None, StepPath.GATHERED_DECODE], ids=["one-shard", "partials"])
def test_decode_over_576_wide_latents(plan):
    """DeepSeek-V3's latent width (512 + 64) and 16 query heads on one latent head: the decode paths (the C
    kernel where it runs) equal float64 attention over the request's latents."""
    gen = torch.Generator().manual_seed(3)
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=(1,), start_pos=ctx, block_table=tuple(range(1 + 12 * i,
              13 + 12 * i)), sample=True, prompt_logits=False) for i, ctx in enumerate((37, 5))]
    meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout, path=plan)).attention
    pool = latent_pool(30 * BLOCK, 512, 64, torch.float32).normal_(generator=gen)
    q = 3.0 * torch.randn(2, 16, 576, generator=gen) / 576**0.5
    backend, scale = MLAPagedBackend(), 192**-0.5
    if plan is None:
        out = backend.attend_decode_whole(q, pool, pool, meta.decode, scale)
    else:
        out, _ = backend.attend_decode(q, pool, pool, meta.decode, scale)
    for i, ctx in enumerate((37, 5)):
        blocks = chunks[i].block_table
        latents = pool[torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx + 1)])]  # [S, 1, 576]
        want, _ = reference_attention(q[i:i + 1].transpose(0, 1).unsqueeze(0).double(),
                                      latents.transpose(0, 1).unsqueeze(0).double(),
                                      latents.transpose(0, 1).unsqueeze(0).double(), scale=scale)
        torch.testing.assert_close(out[i].double(), want[0, :, 0], rtol=1e-5, atol=1e-5)

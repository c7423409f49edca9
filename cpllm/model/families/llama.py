"""The Llama family (Llama 2/3, Mistral and Qwen2 with or without sliding windows, SmolLM2, Qwen3) in one module,
also the decoder of the MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral), whose sparse MLPs are cpllm/model/moe/sparse_block.py.

Every rank builds only its TP shard; attention goes through PagedCPAttention,
which hides context parallelism from the model.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cpllm.config.engine import ModelConfig
from cpllm.config.attention import layer_window
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.distributed.comm import low_latency
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.kernels.decode_rows import rope_qk_, silu_mul, widen_rope_qkv
from cpllm.kernels.rms_norm import add_residual
from cpllm.kernels.prefill_attention import bf16_choice
from cpllm.layers.gqa_triton.choice import kind_for
from cpllm.layers.registry import attention_backend
from cpllm.layers.window.modifier import score_mods
from cpllm.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    RowRange,
    VocabParallelEmbedding,
)
from cpllm.model.execution.fused_decode import FusedDecode
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.mlp_split import DecodeSplitMLP, can_split
from cpllm.model.moe.sparse_block import SparseMoEBlock
from cpllm.model.moe.log import moe_summary_lines
from cpllm.model.layer_kinds_log import layer_kinds_lines
from cpllm.model.formats.report import summary_lines, weight_bytes
from cpllm.model.rope import RotaryEmbedding, apply_rope

logger = logging.getLogger(__name__)

ATTENTION_KIND = "gqa"
"""The family's attention: grouped-query heads over the paged K/V pools (`BACKENDS` in backend.py)."""


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None = None, window: int | None = None):
        """`window`: this layer's sliding window (Mistral, Qwen2; None: full attention)."""
        super().__init__()
        d = config.head_dim
        self.num_heads = config.num_attention_heads // parallel.size("tp")
        first_kv, self.num_kv_heads = parallel.kv_heads(config.num_key_value_heads)
        q0 = parallel.rank("tp") * self.num_heads * d
        kv0 = first_kv * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                RowRange(name=f"{prefix}.q_proj", start=q0, end=q0 + self.num_heads * d),
                RowRange(name=f"{prefix}.k_proj", start=kv0, end=kv0 + self.num_kv_heads * d),
                RowRange(name=f"{prefix}.v_proj", start=kv0, end=kv0 + self.num_kv_heads * d),
            ],
            bias=config.attention_bias,
            dtype=dtype,
            quantization=config.quantization,
        )
        self.o_proj = RowParallelLinear(
            f"{prefix}.o_proj", config.num_attention_heads * d, config.hidden_size, parallel, dtype,
            config.quantization
        )
        # only a windowed layer names a window: full layers keep every fast path of PagedCPAttention
        self.attn = PagedCPAttention(parallel, scale=d**-0.5, backend=backend, mods=score_mods(window=window))
        self.window = window
        self.head_dim = d
        self.q_norm = self.k_norm = None  # Qwen3: RMSNorm over each head's width before rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(f"{prefix}.q_norm.weight", d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(f"{prefix}.k_norm.weight", d, config.rms_norm_eps, dtype)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype `rows` rows of input are rounded to first (only qkv_proj reads them), or None."""
        return self.qkv_proj.input_dtype(rows)

    def forward(self, hidden, rope_tables, kv_cache, meta: AttentionMetadata, keep: torch.Tensor | None = None,
                native: bool = False):
        """`keep`: the rows whose output is needed (every row's K/V is still stored and attended); None: all.
        `native`: the output in the dtype o_proj rounded it to (RowParallelLinear.forward)."""
        n, d = hidden.shape[0], self.head_dim
        qkv, roped = self._qkv(hidden, rope_tables)  # [N, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not roped and not rope_qk_(rope_tables, q, k):  # in place, one C call (eager CPU float32), or torch's ops
            q = apply_rope(rope_tables, q)  # [N, Hq, D]
            k = apply_rope(rope_tables, k)  # [N, Hkv, D]
        v = v.reshape(n, self.num_kv_heads, d)
        # in o_proj's GEMM dtype where the attention can write it so (no float32 copy in between)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, out_dtype=self.o_proj.input_dtype(n))
        out = out.reshape(n, self.num_heads * d)  # [N, Hq * D]
        if keep is not None:
            if keep.numel() == 0:
                return out[:0]  # no row wanted: no projection (nor its all-reduce) on any rank
            out = out.index_select(0, keep)
        return self.o_proj(out, native=native)


    def _qkv(self, hidden, rope_tables) -> tuple[torch.Tensor, bool]:
        """q|k|v in the model's dtype, and whether q and k are rotated already: a bf16 GEMM's output (the default
        path's prefill) widened and rotated in one C pass where no q/k norm comes between (the bits of the widening
        copy and `rope_qk_`), else the projection as it is."""
        qkv = self.qkv_proj(hidden, native=self.q_norm is None)
        if qkv.dtype == self.qkv_proj.dtype:
            return qkv, False
        roped = widen_rope_qkv(rope_tables, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        return (qkv.to(self.qkv_proj.dtype), False) if roped is None else (roped, True)


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 decode_split: bool = False):
        """`decode_split`: split decode-only steps over the PCP ranks where they divide the shard (sharded KV layout,
        PCP > 1, cheap collectives; cpllm/model/mlp_split.py); False: always the whole shard."""
        super().__init__()
        shard = config.intermediate_size // parallel.size("tp")
        start = parallel.rank("tp") * shard
        self.shard = shard
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                RowRange(name=f"{prefix}.gate_proj", start=start, end=start + shard),
                RowRange(name=f"{prefix}.up_proj", start=start, end=start + shard),
            ],
            bias=False,
            dtype=dtype,
            quantization=config.quantization,
        )
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", config.intermediate_size, config.hidden_size,
                                           parallel, dtype, config.quantization)
        self.decode_split = None
        if decode_split and can_split(shard, config.hidden_size, parallel.size("pcp")):
            self.decode_split = DecodeSplitMLP(prefix, config.hidden_size, start, shard, parallel, dtype,
                                               config.quantization)

    def after_load(self, source: WeightSource) -> None:
        """Once the projections are loaded (their format known): the decode split's slices, or no split where they
        cannot be sliced (the rank's capabilities then read that no MLP splits: cpllm/worker/rank_capabilities.py)."""
        if self.decode_split is not None:
            self.decode_split.load_from(source, self.gate_up_proj, self.down_proj)
            if not self.decode_split.usable:
                self.decode_split = None

    def input_dtype(self, rows: int, meta: AttentionMetadata | None = None) -> torch.dtype | None:
        """The dtype `rows` rows of input are rounded to first, or None (the decode split reads float32)."""
        return None if self._splits(meta) else self.gate_up_proj.input_dtype(rows)

    def _splits(self, meta: AttentionMetadata | None) -> bool:
        # the step's plan says whether the MLPs split (plan.py `StepPlan.mlp_split`: same rows on every PCP rank)
        return meta is not None and meta.plan.mlp_split and self.decode_split is not None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None, native: bool = False) -> torch.Tensor:
        """`native`: the output in the dtype down_proj rounded it to (RowParallelLinear.forward)."""
        if self._splits(meta):
            return self.decode_split(x)
        gate_up = self.gate_up_proj(x, native=True)  # the model's dtype, or a bf16 GEMM's own bf16 output
        return self.down_proj(self._activation(gate_up, x.shape[0]), native=native)

    def _activation(self, gate_up: torch.Tensor, rows: int) -> torch.Tensor:
        """silu(gate) * up: one C call on eager CPU steps (as the fused decode layer) where it applies, else torch's
        ops. A bf16 GEMM's output is read as it is, and the result rounded to bf16 here where down_proj would
        round it anyway: the values of the float32 flow, without two wide copies."""
        dtype = self.down_proj.dtype
        if gate_up.dtype != dtype:
            narrow = self.down_proj.input_dtype(rows) == gate_up.dtype
            act = silu_mul(gate_up, self.shard, gate_up.dtype if narrow else dtype)
            if act is not None:
                return act
            gate_up = gate_up.to(dtype)
        act = silu_mul(gate_up, self.shard) if dtype == torch.float32 else None
        if act is None:
            gate, up = gate_up.split(self.shard, dim=-1)
            act = F.silu(gate) * up
        return act


class PendingResidual(NamedTuple):
    """A layer's output left as a sum still to make, residual + delta (the MLP's bf16 output), for the next layer
    to add in its input norm's one pass (cpllm_add_rms_norm) instead of a pass of its own: the same bits."""

    residual: torch.Tensor
    """The float32 residual stream before the MLP's output is added."""
    delta: torch.Tensor
    """The MLP's output, as its GEMM rounded it."""

    def resolve(self) -> torch.Tensor:
        """The sum, in a pass of its own (for a layer that does not take it into its norm)."""
        return add_residual(self.residual, self.delta)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None = None, max_positions: int | None = None):
        """`max_positions`: the longest request, against which a layer's window is compared (a window no shorter
        is no window)."""
        super().__init__()
        prefix = f"model.layers.{index}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", parallel, dtype, backend,
                                        layer_window(config, index, max_positions))
        self.post_attention_layernorm = RMSNorm(
            f"{prefix}.post_attention_layernorm.weight", config.hidden_size, eps, dtype
        )
        if config.moe is not None and config.moe.is_sparse(index):
            self.mlp = SparseMoEBlock(config, f"{prefix}.{config.moe.expert_prefix}", parallel, dtype)
        else:
            # Replicated layout: PCP ranks hold different tokens. Over gloo's TCP the extra collectives cost more
            # than the halved weight streaming saves.
            split = not parallel.dims.kv_replicated and low_latency(parallel.group("pcp"))
            self.mlp = LlamaMLP(config, f"{prefix}.mlp", parallel, dtype, split)

    def forward(self, hidden, rope_tables, kv_cache, meta, keep: torch.Tensor | None = None, defer: bool = False):
        """`keep`: the rows to compute past attention (the last layer of a step that samples from a few rows).

        Where the projections run bf16 GEMMs (the default path's prefill), each norm is rounded to bf16 as it is
        written and o_proj's bf16 output is added to the residual as it is (the residual stays float32): the bits
        of the float32 flow, whose casts the GEMMs would make anyway. `hidden` may be the previous layer's
        PendingResidual, and with `defer` (the next layer takes one) this layer's output is one where its MLP
        gave bf16."""
        narrow = getattr(self.self_attn, "input_dtype", None)  # an attention or MLP that has it takes `native`
        if narrow is None:
            hidden = hidden.resolve() if isinstance(hidden, PendingResidual) else hidden
            attn = self.self_attn(self.input_layernorm(hidden), rope_tables, kv_cache, meta, keep)
        else:
            residual, delta = hidden if isinstance(hidden, PendingResidual) else (hidden, None)
            hidden, normed = self.input_layernorm.add_and_norm(residual, delta, narrow(residual.shape[0]))
            attn = self.self_attn(normed, rope_tables, kv_cache, meta, keep, native=True)
        if keep is not None and keep.numel() == 0:  # no row wanted: the K/V store was all there was to do
            return hidden[:0]
        residual = hidden if keep is None else hidden.index_select(0, keep)
        mlp_input = getattr(self.mlp, "input_dtype", None)
        if mlp_input is None:
            hidden, normed = self.post_attention_layernorm.add_and_norm(residual, attn, None)
            return hidden + self.mlp(normed, meta)
        hidden, normed = self.post_attention_layernorm.add_and_norm(residual, attn,
                                                                    mlp_input(residual.shape[0], meta))
        delta = self.mlp(normed, meta, native=True)
        return PendingResidual(hidden, delta) if defer else add_residual(hidden, delta)


def takes_pending_residual(layer: torch.nn.Module) -> bool:
    """`layer` runs LlamaDecoderLayer's forward, which takes the previous layer's PendingResidual."""
    return getattr(type(layer), "forward", None) is LlamaDecoderLayer.forward


def call_layer(layer: LlamaDecoderLayer, hidden, rope_tables, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
    # hidden [N, hidden_size] -> [N, hidden_size]
    return layer(hidden, rope_tables, kv_cache, meta)


class LlamaForCausalLM(torch.nn.Module):
    """Decoder stack; `forward` returns final hidden states, `logits` applies the LM head to chosen rows."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype, max_positions: int):
        """`parallel`: this rank's parallel context (cpllm/distributed/parallel_context.py): its TP shard, the PCP
        group decode-only steps may split the dense MLPs and the LM head over, the MoE group of a MoE model, the
        groups the attention talks over."""
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.attention_backend = attention_backend(self.attention_kind())
        """Every layer's attention on this rank (cpllm/context_parallel/backend.py)."""
        self.embed_tokens = self.embedding(config, parallel, dtype)
        self.layers = torch.nn.ModuleList(
            self.decoder_layer(config, i, parallel, dtype, max_positions)
            for i in range(config.num_hidden_layers)
        )
        takes = [takes_pending_residual(layer) for layer in self.layers]
        self.defers_residual = tuple(a and b for a, b in zip(takes, takes[1:])) + (False,)
        """Per layer: its eager forward hands the next layer a PendingResidual (both run LlamaDecoderLayer's
        forward; never the last)."""
        self.norm = self.final_norm(config, dtype)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        # the head split adds one collective per step: only where collectives are cheap
        self.lm_head = ParallelLMHead(tied, "lm_head.weight", config.vocab_size, h, parallel, dtype,
                                      config.quantization, split_over_pcp=low_latency(parallel.group("pcp")))
        self.rope = self.rotary(config, max_positions)
        self.fused_decode: FusedDecode | None = None
        """Decode steps one C call per layer, where the loaded layers allow it (set by load_weights)."""
        self.max_positions = max_positions
        """The longest request (max_model_len), for the start-up log of the layers' K/V."""

    # ---- what a family built on this stack replaces (Gemma, GPT-OSS, DeepSeek) ----------------------------------

    def attention_kind(self) -> str:
        """The `BACKENDS` key of every layer's attention (here: GQA, on the Triton kernels on CUDA)."""
        return kind_for(ATTENTION_KIND)

    def embedding(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype) -> torch.nn.Module:
        return VocabParallelEmbedding("model.embed_tokens.weight", config.vocab_size, config.hidden_size, parallel,
                                      dtype, config.quantization)

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return LlamaDecoderLayer(config, index, parallel, dtype, self.attention_backend, max_positions)

    def final_norm(self, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        return RMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype)

    def rotary(self, config: ModelConfig, max_positions: int) -> torch.nn.Module:
        return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, max_positions)

    def load_weights(self, source: WeightSource) -> None:
        for module in list(self.modules()):  # loading swaps in quantized submodules
            if hasattr(module, "load") and module is not self and module is not self.lm_head:
                module.load(source)
        self.lm_head.load(source)  # last: a tied head copies the loaded embedding
        for module in list(self.modules()):  # after_load adds modules (the decode splits' slices)
            if hasattr(module, "after_load"):
                module.after_load(source)
        for line in summary_lines(self, self.config.quantization) + moe_summary_lines(self) + layer_kinds_lines(self):
            logger.info("%s", line)
        self.choose_prefill_attention()
        reason = self.eager_decode_reason()
        if reason is not None:
            logger.info("decode steps: eager layers (%s)", reason)
            self.fused_decode = None
        else:
            self.fused_decode = FusedDecode.build(self)

    def choose_prefill_attention(self) -> None:
        """Prefill attention on bf16 dot products where the attention's projections already run an approximate
        format (the default path's int4 / int8 groups) and the backend and CPU can (docs/platform.md); the float32
        path (`--quantization none`) keeps the float32 kernel, exact to its rounding."""
        use = getattr(self.attention_backend, "use_bf16_products", None)  # the GQA backend's (MLA has none)
        if use is None:
            return
        # a hybrid's state layers have no self_attn (their own projections are not attention's)
        projections = [getattr(getattr(layer, "self_attn", None), "qkv_proj", None) for layer in self.layers]
        if any(p is not None and set(weight_bytes(p)) - {"float"} for p in projections):
            how = f"bf16 products ({bf16_choice().way})" if use() else "float32 (no bf16 way pays here)"
            logger.info("prefill attention: %s, the attention projections being approximate formats", how)

    def eager_decode_reason(self) -> str | None:
        """Why this model's decode steps never run the fused C layers (FusedDecode), which compute a Llama layer
        over the whole context; None: FusedDecode.build decides from the loaded layers."""
        if any(getattr(layer.self_attn, "window", None) is not None for layer in self.layers):
            return "sliding-window attention"  # PagedCPAttention applies the window; the C layers do not
        return None

    def last_layer_rows_local(self) -> bool:
        """Past its attention, the last layer computes each row alone (no collective over PCP: the step may keep
        another count of rows on each PCP rank, none on a rank that holds no sampled row). A MoE block all-gathers
        every PCP rank's rows, as many on each."""
        return not any(isinstance(module, SparseMoEBlock) for module in self.layers[-1].modules())

    def pack_weights(self) -> None:
        """Attention projections and shared experts in oneDNN's layout (the routed experts pack at load): for models
        whose float weights no fused decode layer reads in place, and outside compiled graphs (formats/packed_weights.py)."""
        for layer in self.layers:
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                linears += [shared.gate_up_proj, shared.down_proj]
            for linear in linears:
                linear.prepack()

    @torch.inference_mode()
    def forward(self, token_ids, positions, kv_caches, meta: AttentionMetadata,
                keep: torch.Tensor | None = None, layer_meta=None) -> torch.Tensor:
        """token_ids, positions [N] -> hidden [N, hidden_size] (before the final norm), or [len(keep), hidden_size]:
        the rows `keep` names, in its order, with the last layer's projections and MLP run on those rows only
        (each row's result is independent of the others', so the kept rows come out as in the full forward).
        `layer_meta`: each layer's own metadata (its KV group's block tables), see decoder_stack."""
        return self.decoder_stack(token_ids, positions, kv_caches, meta, call_layer, self.fused_decode, keep,
                                  layer_meta)

    def decoder_stack(self, token_ids, positions, kv_caches, meta: AttentionMetadata, run_layer,
                      fused: FusedDecode | None = None, keep: torch.Tensor | None = None,
                      layer_meta: tuple[AttentionMetadata, ...] | None = None) -> torch.Tensor:
        """The forward with each layer run by `run_layer` (`call_layer`, or its compiled form:
        cpllm/model/execution/decode_graph.py), or by `fused` (one C call per layer) for the steps planned fused.
        `layer_meta[i]`: layer i's metadata, laid out with its KV group's block tables (cpllm/kv_groups.py: a model
        with sliding-window and full layers has one table per group); None: `meta` for every layer."""
        hidden = self.embed_tokens(token_ids)
        rope_tables = self.rope.tables(positions, hidden.dtype)  # once per step, for every layer
        if meta.plan.fused:
            if fused is None:
                raise RuntimeError(f"step planned {meta.plan.value!r} but these layers run without fused decode")
            hidden = fused.run(hidden, fused.step_spec(hidden, rope_tables, kv_caches, meta), kv_caches)
            return hidden if keep is None else hidden.index_select(0, keep)
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_step = meta if layer_meta is None else layer_meta[index]
            if index == last and keep is not None:
                return layer(hidden, rope_tables, kv_cache, layer_step, keep)
            if run_layer is call_layer and self.defers_residual[index]:  # the residual add joins the next norm's pass
                hidden = layer(hidden, rope_tables, kv_cache, layer_step, defer=True)
            else:
                hidden = run_layer(layer, hidden, rope_tables, kv_cache, layer_step)
        return hidden  # the last layer is never deferred

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [M, hidden_size] -> logits [M, vocab] float32
        return self.lm_head(self.norm(hidden))

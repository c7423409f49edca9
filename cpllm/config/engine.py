"""Frozen configuration objects and their validation (no I/O, no torch).

Every config is validated when it is built, so an unsupported combination is
refused before any process starts. Values derived at run time (the number of KV
blocks, the rank of this process) live in runtime objects, never here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cpllm.config.attention import (GEMMA_ARCHITECTURES, check_attention_fields, check_compile_decode_attention,
                                    hf_gemma_fields, hf_layer_types)
from cpllm.config.int4_threshold import threshold_override
from cpllm.config.deepseek import DEEPSEEK_MOE_ARCHITECTURES, MLAConfig, deepseek_moe_config
from cpllm.config.moe import MOE_ARCHITECTURES, MoEConfig
from cpllm.config.kimi_linear import (KIMI_LINEAR_ARCHITECTURES, KimiDeltaConfig, check_kimi_options, kimi_fields,
                                      kimi_mla_config, kimi_moe_config)
from cpllm.config.linear_attention import HYBRID_ARCHITECTURES, LinearAttentionConfig, check_hybrid_options
from cpllm.config.sparse_mla import SPARSE_MLA_ARCHITECTURES, IndexerConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.disagg.config import KVTransferConfig, check_disagg, kv_transfer_config
from cpllm.config.rope import resolve_rope_scaling, rope_context_length
from cpllm.distributed.parallel_dims import KV_CACHE_LAYOUTS, REPLICATED, SHARDED, ParallelDims
from cpllm.model.formats.modes import QUANTIZATION_CHOICES, quantization_mode

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           *MOE_ARCHITECTURES, *GEMMA_ARCHITECTURES, *DEEPSEEK_MOE_ARCHITECTURES,
                           *HYBRID_ARCHITECTURES, *KIMI_LINEAR_ARCHITECTURES)
LAYER_TYPES = ("full_attention", "sliding_attention")
"""Values of ModelConfig.layer_types (config.json's spelling)."""
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
"""Families that RMS-normalise every query and key head (over head_dim) before rotary."""
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
PREFILL_STRATEGIES = ("allgather", "ring", "pass-q", "auto")
"""How prefill moves data over PCP: new K/V all-gathered or passed round the ring (pass-KV), queries passed
round the ring (pass-Q), or chosen per step from the step's sizes (auto; see docs/context_parallel.md)."""
COLLECTIVE_TRANSPORTS = ("auto", "gloo")
"""auto: collectives between ranks on one host go through shared memory (CPU, gloo backend), others through
the backend; gloo: always through torch.distributed's backend (to compare, or where /dev/shm is unusable)."""
# QUANTIZATION_CHOICES: how weights run (vLLM's `quantization`), the keys of the mode table
# (cpllm/model/formats/modes.py): auto = a GGUF file's Q4_0 / Q4_1 / Q4_K / Q8_0 tensors as stored, the rest
# dequantized; none = everything dequantized to `dtype`; int8 / int4 = float weights also quantized at load
# (cpllm/model/formats/plan.py has the table).
DEFAULT_QUANTIZATION = "auto"
"""The default of `quantization` everywhere (LLM, the CLI, ModelConfig): a GGUF file's quantized tensors run as
stored; a floating-point checkpoint is unaffected. Comparisons with transformers ask for "none" (the exact path)."""
QUANT_GROUP = 32
"""Input columns per scale in the int4 and int8 formats (a GGUF Q4_0 / Q4_1 / Q8_0 block, a Q4_K sub-block): a
quantized weight's input width on each rank, TP splits included, must be a multiple of it."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    """Hugging Face architecture name, e.g. "LlamaForCausalLM"."""
    vocab_size: int
    """Rows of the token embedding and the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """KV heads per layer (grouped-query attention when fewer than query heads)."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary scaling as in config.json, one of SUPPORTED_ROPE_TYPES (default, linear, dynamic, yarn, llama3);
    replaced when built by the checked copy resolve_rope_scaling returns (its defaults filled in)."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for."""
    tie_word_embeddings: bool = False
    """LM head shares the token embedding's weight."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    sliding_window: int | None = None
    """Span W of the sliding-window layers: query position i sees key positions j with i - W < j <= i. Which
    layers slide is `layer_types`; without it, every layer (Mistral). None: no layer slides."""
    layer_types: tuple[str, ...] = ()
    """Per-layer attention, each one of LAYER_TYPES (config.json's `layer_types`, or the family's rule:
    cpllm/config/attention.py; Qwen2 from max_window_layers, Gemma and GPT-OSS alternate); () = no list."""
    attn_logit_softcapping: float | None = None
    """Gemma2: every attention score s (after the scale) becomes c * tanh(s / c) before the mask and softmax."""
    final_logit_softcapping: float | None = None
    """Gemma2 / Gemma3: every logit l becomes c * tanh(l / c)."""
    query_pre_attn_scalar: float | None = None
    """Gemma: attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)."""
    hidden_activation: str = "silu"
    """The gated MLP's activation: "silu" (Llama family) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    rope_local_theta: float | None = None
    """Gemma3: rotary base of the sliding layers (`rope_local_base_freq`, unscaled); the full layers use
    rope_theta with rope_scaling."""
    attention_sinks: bool = False
    """Every head has a learned logit that joins its softmax denominator and carries no value (GPT-OSS)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end generation."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before rotary (Qwen3)."""
    moe: MoEConfig | None = None
    """The sparse MLP of a mixture-of-experts model (None: dense)."""
    mla: MLAConfig | None = None
    """Multi-head latent attention's shapes (DeepSeek-V2/V3, GLM-4.7-Flash; None: grouped-query attention). With it
    the cache holds one latent row per token and layer, one latent "head" every query head reads:
    num_key_value_heads is 1 and head_dim is the query/key width qk_nope_head_dim + qk_rope_head_dim."""
    indexer: IndexerConfig | None = None
    """DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5; cpllm/config/sparse_mla.py): each query attends
    only the index_topk cached tokens it scores highest. None: every MLA query attends its whole context."""
    linear_attention: LinearAttentionConfig | None = None
    """The gated DeltaNet layers of a linear-attention hybrid (Qwen3.5, Qwen3-Next; cpllm/config/linear_attention.py):
    they keep a state per request; num_key_value_heads and head_dim are the full-attention layers'. None: none."""
    kimi_delta: KimiDeltaConfig | None = None
    """The Kimi delta attention layers of Kimi Linear (cpllm/config/kimi_linear.py): they keep a state per request;
    the other layers are MLA (`mla`). None: none."""
    quantization: str = DEFAULT_QUANTIZATION
    """How the weights run, one of QUANTIZATION_CHOICES. Kept here, as vLLM does, because every rank builds its
    model from this config alone; checks that need the parallel layout are in EngineConfig."""

    def __post_init__(self) -> None:
        quantization_mode(self.quantization)  # a ValueError naming the value and QUANTIZATION_CHOICES
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.qk_norm and self.attention_bias:
            raise ValueError(f"{self.architecture} with attention_bias=True (an o_proj bias) is not supported")
        if self.layer_types:
            _check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        check_attention_fields(self)  # the window and the Gemma fields (cpllm/config/attention.py)
        # checked, and completed with the defaults each type reads (cpllm/config/rope.py)
        object.__setattr__(self, "rope_scaling", resolve_rope_scaling(self.rope_scaling, self.max_position_embeddings))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        kimi = archs[0] in KIMI_LINEAR_ARCHITECTURES
        if kimi:  # DeepSeek's keys from Kimi's spellings (cpllm/config/kimi_linear.py)
            cfg = kimi_fields(cfg)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding, layer_types = hf_layer_types(archs[0], cfg)  # which layers slide (cpllm/config/attention.py)
        mla = MLAConfig.from_hf_config(cfg) if archs[0] in DEEPSEEK_MOE_ARCHITECTURES else \
            kimi_mla_config(cfg) if kimi else None
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            # MLA: one latent row per token that every head reads, replicated over TP like a single KV head
            num_key_value_heads=1 if mla else cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("qkv_bias", True) if archs[0] == "Qwen2MoeForCausalLM"
            else cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM"),
            qk_norm=archs[0] in QK_NORM_ARCHITECTURES,
            moe=kimi_moe_config(cfg) if kimi else deepseek_moe_config(cfg) if mla else MoEConfig.from_hf_config(cfg),
            mla=mla,
            linear_attention=LinearAttentionConfig.from_hf_config(cfg) if archs[0] in HYBRID_ARCHITECTURES
            else None,
            kimi_delta=KimiDeltaConfig.from_hf_config(cfg) if kimi else None,
            indexer=IndexerConfig.from_hf_config(cfg, mla.qk_rope_head_dim)
            if archs[0] in SPARSE_MLA_ARCHITECTURES else None,
            sliding_window=sliding,
            layer_types=layer_types,
            **hf_gemma_fields(archs[0], cfg),
            attention_sinks=archs[0] == "GptOssForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _check_layer_types(layer_types: tuple[str, ...], num_layers: int, window: int | None) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers; the model has num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} unsupported; each must be one of {LAYER_TYPES}")
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r}: sliding_attention layers need a window of at least 1 token")


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelConfig:
    """The parallel options as the user gives them; `dims` holds their sizes, named and validated."""

    tensor_parallel_size: int = 1
    """TP: attention heads and MLP columns split over this many ranks."""
    prefill_context_parallel_size: int = 1
    """PCP: each prompt's new tokens split along the sequence over this many ranks."""
    decode_context_parallel_size: int = 1
    """DCP: the KV cache is also sharded over this many TP ranks (divides TP)."""
    data_parallel_size: int = 1
    """DP: independent engine replicas, each with its own scheduler and KV cache."""
    cp_kv_cache_interleave_size: int = 1
    """Consecutive tokens stored on one CP rank before moving to the next."""
    cp_prefill_strategy: str = "auto"
    """How prefill moves data over PCP ranks, one of PREFILL_STRATEGIES."""
    cp_kv_cache_layout: str = SHARDED
    """Where each token's K/V live, one of KV_CACHE_LAYOUTS."""
    distributed_timeout_s: float = 120.0
    """A collective that waits longer than this fails with an error naming the rank."""
    collective_transport: str = "auto"
    """How the ranks' collectives travel, one of COLLECTIVE_TRANSPORTS."""
    enable_expert_parallel: bool = False
    """MoE models: whole experts split over the TP x PCP ranks instead of every expert's rows (expert-TP)."""

    dims: ParallelDims = field(init=False, repr=False, compare=False)
    """The sizes as named dims (cpllm/distributed/parallel_dims.py), built and validated here, once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", ParallelDims(
            tp=self.tensor_parallel_size, pcp=self.prefill_context_parallel_size,
            dcp=self.decode_context_parallel_size, dp=self.data_parallel_size,
            kv_replicated=self.cp_kv_cache_layout == REPLICATED, expert_parallel=self.enable_expert_parallel))
        interleave = self.cp_kv_cache_interleave_size
        if not isinstance(interleave, int) or interleave < 1:
            raise ValueError(f"cp_kv_cache_interleave_size must be an integer >= 1, got {interleave!r}")
        if self.cp_prefill_strategy not in PREFILL_STRATEGIES:
            raise ValueError(
                f"cp_prefill_strategy={self.cp_prefill_strategy!r}; choose one of {PREFILL_STRATEGIES}"
            )
        if self.cp_kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"cp_kv_cache_layout={self.cp_kv_cache_layout!r}; choose one of {KV_CACHE_LAYOUTS}")
        if self.dims.kv_replicated and self.cp_prefill_strategy == "pass-q":
            raise ValueError(
                "cp_prefill_strategy='pass-q' with cp_kv_cache_layout='replicated': pass-Q keeps new K/V where they "
                "were computed, but the replicated layout needs every new token's K/V on every PCP rank; use "
                "'ring', 'allgather' or 'auto' (which picks 'ring' under this layout)"
            )
        if self.collective_transport not in COLLECTIVE_TRANSPORTS:
            raise ValueError(
                f"collective_transport={self.collective_transport!r}; choose one of {COLLECTIVE_TRANSPORTS}"
            )
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Choices of CacheConfig.kv_cache_dtype (vLLM's --kv-cache-dtype; its fp8 formats are not built)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = 16
    """Tokens per physical KV block on one rank."""
    kv_cache_memory_bytes: int | None = None
    """KV bytes per rank; None sizes it from free memory (logged at startup)."""
    enable_prefix_caching: bool | None = None
    """Reuse full blocks whose token prefix was already computed. None: on, except for the linear-attention hybrids,
    where it is asked for explicitly: their hits start from state snapshots at block boundaries, max_num_seqs more
    per-request states out of the KV budget (cpllm/engine/state_snapshots.py). EngineConfig resolves it to a
    bool."""
    state_snapshots: int | None = None
    """Snapshot slots of a model with state layers under prefix caching: the states after that many prefixes
    (least recently used reused first), each one request's states of every state layer out of the KV budget
    (the capacity log gives the bytes). None: max_num_seqs. Fewer cost less and keep fewer prefix hits."""
    kv_cache_dtype: str = "auto"
    """dtype K/V are stored in, one of KV_CACHE_DTYPES: auto = the model's dtype; a narrower one (bfloat16 or
    float16 under a float32 model) doubles the tokens the cache holds, and attention computes in the model's dtype."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.state_snapshots is not None and (not isinstance(self.state_snapshots, int) or self.state_snapshots < 1):
            raise ValueError(f"state_snapshots must be an integer >= 1 (none at all: turn prefix caching off), got "
                             f"{self.state_snapshots!r}")


@dataclass(kw_only=True, frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_batched_tokens: int = 8192
    """Tokens computed in one step, over all requests (the chunked-prefill budget)."""
    max_num_seqs: int = 64
    """Requests running at once."""
    max_model_len: int = 4096
    """Longest prompt plus output a request may reach."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineConfig:
    """Everything one engine needs, validated together."""

    model_path: str
    """A Hugging Face model folder or a .gguf file."""
    model: ModelConfig
    """The architecture, read from model_path."""
    dtype: str = "float32"
    """Weights and activations dtype."""
    seed: int = 0
    """Seed of requests that carry no seed of their own."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """KV cache."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Batching limits."""
    compile_decode: bool = False
    """Run decode steps through torch.compile (cpllm/model/execution/decode_graph.py): one rank per replica, dense models,
    CPU. Off by default: the first decode steps of a process pay the compile (15-60 s on CPU, cached on disk).
    Steps the fused decode layers take (cpllm/model/execution/fused_decode.py: all-int4 models) run fused instead."""
    enforce_eager: bool = False
    """Never capture CUDA graphs: every decode step runs eager (vLLM's flag). Off: a CUDA rank holding its replica
    alone captures its decode steps per batch-size bucket at start-up and replays them (cpllm/model/execution/cuda_graphs.py);
    no effect on the CPU."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (cpllm/config/speculative.py): how requests are drafted; None = one token per step."""
    kv_transfer_config: KVTransferConfig | None = None
    """Disaggregated prefill/decode (cpllm/disagg/config.py; vLLM's JSON object, read into the record here); None:
    this instance neither sends nor pulls K/V."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {SUPPORTED_DTYPES}")
        self.parallel.dims.validate(self.model)
        interleave = self.parallel.cp_kv_cache_interleave_size
        if interleave > self.cache.block_size or self.cache.block_size % interleave != 0:
            raise ValueError(
                f"cp_kv_cache_interleave_size={interleave} must divide block_size={self.cache.block_size}"
            )
        check_quantized_widths(self.model, self.parallel.tensor_parallel_size)
        threshold_override()  # a bad CPLLM_INT4_GEMM_FROM_ROWS is refused here, before any rank loads weights
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError("speculative_config must be a SpeculativeConfig here (build_engine_config validates "
                             f"the dict), got {type(self.speculative_config).__name__}")
        if self.kv_transfer_config is not None:
            object.__setattr__(self, "kv_transfer_config", kv_transfer_config(self.kv_transfer_config))
            check_disagg(self)
        has_states = self.model.linear_attention is not None or self.model.kimi_delta is not None  # state layers
        if self.cache.enable_prefix_caching is None:  # the default: on wherever a hit costs no state snapshots
            object.__setattr__(self, "cache", dataclasses.replace(self.cache, enable_prefix_caching=not has_states))
        if self.cache.state_snapshots is not None and not (has_states and self.cache.enable_prefix_caching):
            raise ValueError(f"state_snapshots={self.cache.state_snapshots} applies to prefix caching on a model with "
                             "state layers (a linear-attention hybrid); this engine has "
                             f"{'prefix caching off' if has_states else 'no state layers'}")
        if self.model.linear_attention is not None:
            check_hybrid_options(speculative=self.speculative_config is not None, compile_decode=self.compile_decode,
                                 tp=self.parallel.tensor_parallel_size,
                                 pcp=self.parallel.prefill_context_parallel_size, linear=self.model.linear_attention)
        if self.model.kimi_delta is not None:
            check_kimi_options(speculative=self.speculative_config is not None, compile_decode=self.compile_decode,
                               tp=self.parallel.tensor_parallel_size,
                               pcp=self.parallel.prefill_context_parallel_size, kda=self.model.kimi_delta)
        if self.compile_decode:
            _check_compile_decode(self.parallel, self.model)
            check_compile_decode_attention(self.model, self.scheduler.max_model_len)
        context = rope_context_length(self.model.rope_scaling, self.model.max_position_embeddings)
        if self.scheduler.max_model_len > context:
            raise ValueError(
                f"max_model_len={self.scheduler.max_model_len} exceeds the model's context of {context} "
                f"(max_position_embeddings={self.model.max_position_embeddings}, rope_scaling stretches it by "
                "its factor for linear, dynamic and yarn)"
            )


def _check_compile_decode(parallel: ParallelConfig, model: ModelConfig) -> None:
    """compile_decode compiles one rank's whole forward: no collective and no data-dependent routing inside."""
    if parallel.dims.replica_size != 1:
        raise ValueError(
            f"compile_decode=True with tensor_parallel_size={parallel.tensor_parallel_size} and "
            f"prefill_context_parallel_size={parallel.prefill_context_parallel_size}: the compiled decode step needs "
            "one rank per replica (collectives are not compiled); use data_parallel_size for more ranks"
        )
    if model.moe is not None:
        raise ValueError("compile_decode=True with a mixture-of-experts model: expert routing has data-dependent "
                         "shapes that the compiled graph cannot hold; run it without compile_decode")


def check_quantized_widths(model: ModelConfig, tp: int) -> None:
    """An explicit int8 / int4 request must fit the kernel on every TP rank, or it is refused here.

    Input widths (the TP split of o_proj and down_proj included) must be multiples of QUANT_GROUP. `auto` is never
    refused: a GGUF tensor that does not fit runs dequantized, and the start-up log says so (the stored types are
    only known when the file is read).
    """
    mode = model.quantization
    if quantization_mode(mode).float_weights == "float":  # auto and none quantize nothing at load
        return
    in_widths = {
        "hidden_size (input of q/k/v, gate/up and the LM head)": model.hidden_size,
        "o_proj input per TP rank (num_attention_heads * head_dim / tensor_parallel_size)":
            model.num_attention_heads // tp * model.head_dim,
        "down_proj input per TP rank (intermediate_size / tensor_parallel_size)": model.intermediate_size // tp,
    }
    for what, width in in_widths.items():
        if width % QUANT_GROUP != 0:
            raise ValueError(
                f"quantization={mode!r} with tensor_parallel_size={tp}: {what} is {width}, not a multiple of "
                f"{QUANT_GROUP} (the quantization group); use quantization='none' or another tensor_parallel_size"
            )

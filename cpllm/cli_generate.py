"""`cpllm generate`: one prompt, its completion and its timing."""

from __future__ import annotations

import argparse

from cpllm.engine.llm import LLM
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine_args import engine_kwargs


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.request_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    prompt = _read_prompt(args)
    # one sequence runs: a KV pool sized for max_num_seqs of them would be allocated for nothing
    with LLM(args.model, **{**engine_kwargs(args), "max_num_seqs": 1}) as llm:
        if args.chat:
            output = llm.chat([{"role": "user", "content": prompt}], params)[0]
        else:
            output = llm.generate(prompt, params)[0]
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

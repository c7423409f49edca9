"""`cpllm bench prefill | chunk | plan | decode | serve | memory | comm | ceiling`: measure, print a table, write JSON,
plot."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cpllm.bench.common import BenchLayout, machine_info, parse_int_list, parse_layout, parse_str_list, threads_for
from cpllm.bench.report import print_table, write_json

from cpllm.config.engine import PREFILL_STRATEGIES as STRATEGIES


def _add_output_options(parser: argparse.ArgumentParser, *, plot: bool = True) -> None:
    parser.add_argument("--json", default=None, help="write the results here")
    if plot:
        parser.add_argument("--plot", default=None, help="draw the figure to this PNG")


def add_bench_parser(parser: argparse.ArgumentParser, add_engine_arguments: Callable) -> None:
    """Add the bench sub-commands to `parser` (the `cpllm bench` parser)."""
    commands = parser.add_subparsers(dest="bench_command", required=True)

    prefill = commands.add_parser("prefill", help="time to first token vs prompt length, per layout and strategy")
    add_engine_arguments(prefill)
    prefill.add_argument("--lengths", default="1024,2048", help="prompt lengths, comma-separated")
    prefill.add_argument("--layouts", default=None,
                         help="TPxPCPxDCP[@threads_per_rank], comma-separated (default: from -tp/-pcp/-dcp)")
    prefill.add_argument("--strategies", default="allgather,ring", help="PCP prefill strategies to compare")
    prefill.add_argument("--repeats", type=int, default=1,
                         help="runs per point (the fastest is reported, with the median)")
    prefill.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                         help="measure the fp32 matmul ceiling and report the achieved fraction")
    _add_output_options(prefill)

    chunk = commands.add_parser("chunk", help="TTFT of a short chunk on a cached context, per layout and strategy")
    add_engine_arguments(chunk)
    chunk.add_argument("--context", type=int, default=8000, help="cached context tokens")
    chunk.add_argument("--chunk", type=int, default=256, help="new tokens on top of it")
    chunk.add_argument("--layouts", default=None, help="TPxPCPxDCP[@threads], comma-separated")
    chunk.add_argument("--strategies", default="ring,pass-q,auto", help="PCP prefill strategies to compare")
    chunk.add_argument("--repeats", type=int, default=3, help="chunks timed per layout (fastest and median)")
    _add_output_options(chunk, plot=False)

    planner = commands.add_parser("plan", help="cpllm plan --calibrate's TTFT against measured PCP=1 and PCP=2 "
                                  "prefills (one thread per rank, auto strategy), and PCP=2's parallel efficiency")
    add_engine_arguments(planner)
    planner.add_argument("--lengths", default="4096,8000", help="prompt lengths, comma-separated")
    planner.add_argument("--repeats", type=int, default=3, help="calibrations and runs per point")
    _add_output_options(planner, plot=False)

    decode = commands.add_parser("decode", help="steady decode tokens/s per batch size and context length")
    add_engine_arguments(decode)
    decode.add_argument("--batch-sizes", default="1,16")
    decode.add_argument("--context-lengths", default="128,2048")
    decode.add_argument("--layouts", default=None, help="TPxPCPxDCP[@threads], comma-separated")
    decode.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    decode.add_argument("--rounds", type=int, default=1,
                        help="run every layout this many times, in rotated order (compare layouts within a round)")
    decode.add_argument("--shared-prefix", action="store_true",
                        help="prompts of a batch share all but their last token (one long prefill per batch)")
    _add_output_options(decode)

    serve = commands.add_parser("serve", help="concurrent streamed requests against a server")
    add_engine_arguments(serve)
    serve.add_argument("--url", default=None,
                       help="base URL of a running server (default: start `cpllm serve` with the engine flags)")
    serve.add_argument("--num-requests", type=int, default=32)
    serve.add_argument("--concurrency", type=int, default=8)
    serve.add_argument("--prompt-tokens", type=int, default=128, help="random token-id prompt length")
    serve.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request (EOS ignored)")
    serve.add_argument("--vocab-size", type=int, default=None, help="bound of random prompt ids (default: the model's)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--server-log", default=None, help="where a launched server writes its log")
    _add_output_options(serve)

    memory = commands.add_parser("memory", help="KV bytes per rank and longest prompt at a fixed per-rank budget")
    add_engine_arguments(memory)
    memory.add_argument("--cp-sizes", default="1,2,4")
    memory.add_argument("--budget", default="64MiB", help="KV cache bytes per rank")
    _add_output_options(memory, plot=False)

    comm = commands.add_parser("comm", help="bytes per prefill layer per strategy: formula vs measured")
    add_engine_arguments(comm)
    comm.add_argument("--lengths", default="2048")
    comm.add_argument("--strategies", default="allgather,ring")
    _add_output_options(comm, plot=False)

    ceiling = commands.add_parser("ceiling", help="this machine's fp32, bf16 and int8 matmul and weight-streaming rates")
    ceiling.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ceiling.add_argument("--size", type=int, default=2048, help="matmul side")
    _add_output_options(ceiling, plot=False)


def run_bench(args: argparse.Namespace) -> int:
    handlers = {"prefill": _prefill, "chunk": _chunk, "decode": _decode, "serve": _serve, "memory": _memory, "comm": _comm,
                "ceiling": _ceiling, "plan": _plan}
    import os

    load_at_start = [round(x, 2) for x in os.getloadavg()]
    try:
        payload = handlers[args.bench_command](args)
    except ValueError as error:
        raise SystemExit(f"cpllm bench {args.bench_command}: {error}") from None
    if args.json:
        import sys

        argv = ["cpllm", *sys.argv[1:]] if sys.argv and sys.argv[0].endswith(("cpllm", "__main__.py")) else None
        machine = {**machine_info(), "load_average_start": load_at_start}
        machine["load_average_end"] = machine.pop("load_average")
        write_json(args.json, {"command": args.bench_command, "argv": argv, "machine": machine, **payload})
    return 0


# ---- handlers -------------------------------------------------------------------------------------------

def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.engine_args import engine_kwargs

    return engine_kwargs(args)


def _layouts(args: argparse.Namespace) -> list[BenchLayout]:
    if args.layouts:
        return [parse_layout(text) for text in args.layouts.split(",") if text.strip()]
    return [BenchLayout.of(tp=args.tensor_parallel_size, pcp=args.prefill_context_parallel_size,
                   dcp=args.decode_context_parallel_size)]


class _Progress:
    """A tqdm bar fed by the bench loops' per-point callback."""

    def __init__(self, total: int, desc: str, unit: str = "point"):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit)

    def __call__(self, note: str | None = None) -> None:
        if note:
            self.bar.set_postfix_str(note)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _prefill(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.ceiling import measure_ceilings
    from cpllm.bench.prefill import layout_runs, parallel_efficiency, run_prefill_bench

    lengths = parse_int_list(args.lengths, "--lengths")
    layouts = _layouts(args)
    strategies = parse_str_list(args.strategies, "--strategies", STRATEGIES)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    progress = _Progress(len(layout_runs(layouts, strategies)) * len(lengths) * args.repeats, "prefill")
    thread_counts = sorted({threads_for(layout, args.threads_per_rank) * layout.dims.world_size for layout in layouts})
    # the ceiling is measured before and after the runs and the better kept: other load only lowers it
    before = measure_ceilings(thread_counts) if args.ceiling else {}
    try:
        results = run_prefill_bench(args.model, lengths=lengths, layouts=layouts, strategies=strategies,
                                    threads_per_rank=args.threads_per_rank, repeats=args.repeats,
                                    engine_options=_engine_options(args), progress=progress)
    finally:
        progress.close()
    rows = [r.row() for r in results]
    payload: dict[str, Any] = {"results": rows, "efficiency": parallel_efficiency(results)}
    if args.ceiling:
        after = measure_ceilings(thread_counts)
        ceilings = {t: {k: max(v, before[t][k]) for k, v in after[t].items()} for t in thread_counts}
        for row in rows:
            row["ceiling_fraction"] = round(row["gflops"] / ceilings[row["threads"]]["matmul_gflops"], 3)
        payload["ceilings"] = {str(t): c for t, c in ceilings.items()}
    print_table("prefill (ttft_s: best of the repeats)", rows)
    print_table("parallel efficiency: TTFT(1 rank) / (ranks x TTFT)", payload["efficiency"])
    if args.plot:
        from cpllm.bench.plot import plot_prefill

        plot_prefill(rows, args.plot)
    return payload


def _chunk(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.chunk import run_chunk_bench
    from cpllm.bench.prefill import layout_runs

    layouts = _layouts(args)
    strategies = parse_str_list(args.strategies, "--strategies", STRATEGIES)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    progress = _Progress(len(layout_runs(layouts, strategies)) * args.repeats, "chunk")
    try:
        results = run_chunk_bench(args.model, context=args.context, chunk=args.chunk, layouts=layouts,
                                  strategies=strategies, threads_per_rank=args.threads_per_rank,
                                  repeats=args.repeats, engine_options=_engine_options(args), progress=progress)
    finally:
        progress.close()
    rows = [r.row() for r in results]
    print_table(f"TTFT of {args.chunk} new tokens on {args.context} cached (best and median of the repeats)", rows)
    return {"results": rows}


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.plan_check import LAYOUTS, run_plan_check

    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    progress = _Progress(len(LAYOUTS) * args.repeats, "plan")
    try:
        payload = run_plan_check(args.model, lengths=parse_int_list(args.lengths, "--lengths"), repeats=args.repeats,
                                 engine_options=_engine_options(args), progress=progress)
    finally:
        progress.close()
    print_table("cpllm plan --calibrate vs measured TTFT (fastest repeat of each)", payload["points"])
    print_table("PCP=2 parallel efficiency: TTFT(1 rank) / (2 x TTFT(PCP=2)), one thread per rank",
                payload["efficiency"])
    return payload


def _decode(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.decode import run_decode_bench

    batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
    contexts = parse_int_list(args.context_lengths, "--context-lengths")
    layouts = _layouts(args)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    progress = _Progress(args.rounds * len(layouts) * len(batch_sizes) * len(contexts), "decode")
    try:
        results = run_decode_bench(args.model, batch_sizes=batch_sizes, context_lengths=contexts, layouts=layouts,
                                   strategy=args.cp_prefill_strategy, steps=args.steps,
                                   threads_per_rank=args.threads_per_rank, engine_options=_engine_options(args),
                                   shared_prefix=args.shared_prefix, rounds=args.rounds, progress=progress)
    finally:
        progress.close()
    rows = [r.row() for r in results]
    print_table("decode", rows)
    if args.plot:
        from cpllm.bench.plot import plot_decode

        plot_decode(rows, args.plot)
    return {"results": rows}


def _serve(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib

    from cpllm.bench.engines import model_config_of
    from cpllm.bench.serve_load import run_serve_bench
    from cpllm.bench.server_launch import launched_server
    from cpllm.engine_args import engine_flags

    vocab = args.vocab_size or model_config_of(args.model).vocab_size
    if args.url:
        server = contextlib.nullcontext(args.url)
    else:
        server = launched_server(engine_flags(args), log_path=args.server_log)
    progress = _Progress(args.num_requests, "serve", unit="request")
    try:
        with server as url:
            result = run_serve_bench(url, num_requests=args.num_requests, concurrency=args.concurrency,
                                     prompt_tokens=args.prompt_tokens, max_tokens=args.output_tokens,
                                     vocab_size=vocab, api_key=args.api_key, progress=progress)
    finally:
        progress.close()
    summary = result.summary()
    print_table("serving load", [summary])
    per_request = [{"ttft_ms": round(1000 * t.ttft_s, 2),
                    "tpot_ms": None if t.tpot_s is None else round(1000 * t.tpot_s, 2),
                    "output_tokens": t.output_tokens} for t in result.timings]
    if args.plot:
        from cpllm.bench.plot import plot_serve

        plot_serve([r["ttft_ms"] for r in per_request],
                   [r["tpot_ms"] for r in per_request if r["tpot_ms"] is not None], args.plot)
    return {"summary": summary, "requests": per_request}


def _memory(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.memory import run_memory_bench
    from cpllm.engine_args import parse_bytes

    cp_sizes = parse_int_list(args.cp_sizes, "--cp-sizes")
    progress = _Progress(len(cp_sizes), "memory")
    try:
        results = run_memory_bench(args.model, cp_sizes=cp_sizes, budget_bytes=parse_bytes(args.budget),
                                   threads_per_rank=args.threads_per_rank or 1, block_size=args.block_size,
                                   progress=progress)
    finally:
        progress.close()
    rows = [r.row() for r in results]
    print_table("KV cache per rank at a fixed budget", rows)
    return {"results": rows}


def _comm(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.comm_volume import run_comm_bench

    rows = run_comm_bench(args.model, lengths=parse_int_list(args.lengths, "--lengths"),
                          pcp=max(2, args.prefill_context_parallel_size), tp=args.tensor_parallel_size,
                          strategies=parse_str_list(args.strategies, "--strategies", STRATEGIES),
                          threads_per_rank=args.threads_per_rank or 1)
    print_table("bytes received per rank per prefill layer", rows)
    return {"results": rows}


def _ceiling(args: argparse.Namespace) -> dict[str, Any]:
    from cpllm.bench.ceiling import measure_ceilings

    ceilings = measure_ceilings(parse_int_list(args.threads, "--threads"), size=args.size, low_precision=True)
    rows = [{"threads": t, **c} for t, c in ceilings.items()]
    print_table("machine ceilings (fp32; bf16 and int8 matmuls)", rows)
    return {"results": rows}

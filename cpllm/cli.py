"""`cpllm generate | serve | router | bench | plan`."""

from __future__ import annotations

import argparse
import logging
import sys

from cpllm.cli_generate import add_sampling_arguments
from cpllm.engine_args import add_engine_arguments


def _generate(args: argparse.Namespace) -> int:
    from cpllm.cli_generate import run_generate

    return run_generate(args)


def _serve(args: argparse.Namespace) -> int:
    from cpllm.server.launcher import run_server

    return run_server(args)


def _router(args: argparse.Namespace) -> int:
    from cpllm.router.cli import run_router

    return run_router(args)


def _plan(args: argparse.Namespace) -> int:
    from cpllm.planner.cli import run_plan

    return run_plan(args)


def _bench(args: argparse.Namespace) -> int:
    from cpllm.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpllm", description="LLM inference with context parallelism")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt and print timing")
    add_engine_arguments(generate)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None, help="model folder or .gguf (or use --model)")
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--served-model-name", default=None)
    from cpllm.server.options import add_serve_arguments  # the server's own flags live with the server

    add_serve_arguments(serve)
    serve.set_defaults(handler=_serve)

    from cpllm.router.cli import add_router_parser

    router = commands.add_parser("router", help="OpenAI API in front of prefill and decode instances "
                                 "(disaggregated prefill/decode)")
    add_router_parser(router)
    router.set_defaults(handler=_router)

    try:
        from cpllm.bench.cli import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        bench = commands.add_parser("bench", help="prefill / decode / serve benchmarks")
        add_bench_parser(bench, add_engine_arguments)
        bench.set_defaults(handler=_bench)
    from cpllm.planner.cli import add_plan_parser

    planner = commands.add_parser("plan", help="predict TTFT, decode speed and memory of every layout of a cluster")
    add_plan_parser(planner)
    planner.set_defaults(handler=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    return args.handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())

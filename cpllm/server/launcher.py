"""`cpllm serve`: build the engine (and its worker ranks), then serve HTTP with uvicorn until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from cpllm.engine.llm import LLM
from cpllm.engine_args import engine_kwargs
from cpllm.server.app import build_app
from cpllm.server.async_engine import AsyncEngine
from cpllm.server.http_server import DrainingServer, exit_now
from cpllm.server.metrics import ServerMetrics
from cpllm.server.options import ServeOptions, serve_options, served_model_name

logger = logging.getLogger(__name__)


def serve_engine_kwargs(args: argparse.Namespace, options: ServeOptions) -> dict:
    """The engine's keywords, with vLLM's serve flags that act on the engine applied: --gpu-memory-utilization
    becomes a KV budget, --load-format is checked against the model path."""
    kwargs = engine_kwargs(args)
    path = args.model_path or args.model
    is_gguf = path is None or path.endswith(".gguf")  # no path: the default model is a GGUF file
    if options.load_format != "auto" and (options.load_format == "gguf") != is_gguf:
        raise ValueError(f"--load-format {options.load_format} does not match the model {path or '(default GGUF)'}")
    if options.gpu_memory_utilization is not None:
        if kwargs.get("kv_cache_memory_bytes") is not None:
            raise ValueError("give --gpu-memory-utilization or --kv-cache-memory-bytes, not both")
        kwargs["kv_cache_memory_bytes"] = kv_bytes_for_utilization(options.gpu_memory_utilization, args)
    return kwargs


def kv_bytes_for_utilization(fraction: float, args: argparse.Namespace) -> int:
    """KV bytes per rank for --gpu-memory-utilization: that fraction of a GPU's free memory (one rank per GPU), or
    on the CPU of the host's available memory split among the ranks it runs."""
    import torch  # noqa: PLC0415 - the launcher needs torch only for this

    from cpllm.worker.kv_cache import available_memory_bytes  # noqa: PLC0415

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    ranks = 1 if on_gpu else args.data_parallel_size * args.prefill_context_parallel_size * args.tensor_parallel_size
    budget = int(available_memory_bytes(device) * fraction / ranks)
    logger.info("--gpu-memory-utilization %g: %.1f MiB of KV cache per rank (%d rank(s) on this %s)", fraction,
                budget / 2**20, ranks, "GPU" if on_gpu else "host")
    return budget


def run_server(args: argparse.Namespace) -> int:
    """`cpllm serve`: serves until SIGTERM or until no replica can serve, then ends the process (see exit_now)."""
    try:
        options = serve_options(args)  # a bad flag fails here, before the model loads
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        kwargs = serve_engine_kwargs(args, options)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if options.api_server_count > 1:
        from cpllm.server.api_servers import run_api_servers  # noqa: PLC0415 - it imports this module

        run_api_servers(args, options, kwargs)  # never returns: ends the process
    llm = LLM(args.model_path or args.model, **kwargs)  # other ranks never return from here
    name = served_model_name(args, llm.engine.config.model_path)
    engine = AsyncEngine(llm.engine, ServerMetrics(name))
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None  # vLLM's environment variable too
    app = build_app(engine, model_name=name, api_key=api_key, options=options)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", args.host,
                       "" if api_key else " without an API key")
    logger.info("serving %r (max_model_len=%d) on http://%s:%d/v1", name, llm.engine.max_model_len,
                args.host, args.port)
    # uvicorn's own deadline is the backstop: by then end_all has ended every request
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=options.shutdown_timeout_s + 1.0)
    server = DrainingServer(config, engine, options.shutdown_timeout_s)
    engine.on_failure = server.engine_failed
    try:
        server.run()
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
    code = server.exit_code if server.started else 1
    logger.info("exiting with status %d", code)
    exit_now(code)

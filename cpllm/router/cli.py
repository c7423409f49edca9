"""`cpllm router --prefill URL... --decode URL...`: serve the router with uvicorn until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_router_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                        help="prefill instances' base URLs (cpllm serve with a kv_producer --kv-transfer-config)")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                        help="decode instances' base URLs (cpllm serve with a kv_consumer --kv-transfer-config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="longest wait for an instance's answer or between two chunks of a stream")
    parser.add_argument("--health-interval-s", type=float, default=2.0,
                        help="how often every /health (and a healthy instance's /metrics) is polled")


def run_router(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415 - only this command needs the web stack

    from cpllm.router.app import build_router_app  # noqa: PLC0415
    from cpllm.router.config import RouterConfig  # noqa: PLC0415

    try:
        config = RouterConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                              request_timeout_s=args.request_timeout_s, health_interval_s=args.health_interval_s)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("router on http://%s:%d: prefill %s, decode %s", args.host, args.port, ", ".join(config.prefill_urls),
                ", ".join(config.decode_urls))
    uvicorn.run(build_router_app(config), host=args.host, port=args.port, log_level="warning")
    return 0

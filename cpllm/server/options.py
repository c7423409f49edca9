"""`cpllm serve`'s own options (limits, tool calling), their defaults, and their command-line flags."""

from __future__ import annotations

import argparse
import dataclasses

from cpllm.engine_args import parse_bytes

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""Names accepted by --tool-call-parser (vLLM's names for the same formats)."""

MIN_BODY_BYTES = 1 * 2**20
"""The automatic body limit never goes below this."""
BODY_BYTES_PER_TOKEN = 32
"""Automatic body limit per token of max_model_len: room for JSON escapes and token-id lists (~7 B per id)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    """Limits and features of the HTTP front; the engine knows nothing of them."""

    max_request_body_bytes: int | None = None
    """Bodies above this get 413 before they are parsed; None = max(1 MiB, 32 bytes x max_model_len)."""
    max_n: int = 16
    """Largest `n` (choices per prompt) one request may ask for; above it, 400."""
    max_queued_requests: int = 256
    """Sequences (prompts x n) that may wait beyond --max-num-seqs running ones; past that, 429 with Retry-After."""
    retry_after_s: int = 1
    """Seconds a 429 response tells the client to wait (its Retry-After header)."""
    enable_auto_tool_choice: bool = False
    """Parse the model's own tool calls when tool_choice is "auto" (needs tool_call_parser)."""
    tool_call_parser: str | None = None
    """The model's tool-call format: one of TOOL_CALL_PARSERS."""
    shutdown_timeout_s: float = 20.0
    """After SIGTERM, seconds requests in flight get to finish; then each is ended with an error (a stream with an
    error event and [DONE]) and the process exits. 20 s plus about a second of teardown fits Kubernetes' default
    30 s grace period with room for a preStop hook or a load balancer's deregistration delay."""

    def __post_init__(self) -> None:
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be >= 1024, got {self.max_request_body_bytes}")
        for name in ("max_n", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(f"--shutdown-timeout must be in [0, 3600] seconds, got {self.shutdown_timeout_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")

    def body_limit(self, max_model_len: int) -> int:
        """The body limit in bytes for a server of this max_model_len."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ServeOptions (vLLM's names where vLLM has the option)."""
    defaults = ServeOptions()
    group = parser.add_argument_group("server limits and tools")
    group.add_argument("--max-request-body-bytes", type=parse_bytes, default=None,
                       help="413 for larger bodies, before parsing (default: max(1MiB, 32 B x max_model_len))")
    group.add_argument("--max-n", type=int, default=defaults.max_n,
                       help="largest n per request (default: %(default)s)")
    group.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                       help="sequences (prompts x n) allowed to wait beyond --max-num-seqs; then 429 with "
                            "Retry-After (default: %(default)s)")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s, metavar="SECONDS",
                       help="after SIGTERM, how long requests in flight may finish before each is ended with an "
                            "error event; the process exits about a second later (default: %(default)s, inside "
                            "Kubernetes' 30 s grace period)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='parse tool calls from the model\'s output for tool_choice="auto"')
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="the model's tool-call format (hermes: <tool_call>{...}</tool_call>, as Qwen and "
                            "Hermes models write; llama3_json: {\"name\": ..., \"parameters\": ...})")


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                        max_queued_requests=args.max_queued_requests,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser, shutdown_timeout_s=args.shutdown_timeout)

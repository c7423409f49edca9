"""`cpllm serve`'s own options (limits, tool calling), their defaults, and their command-line flags.

Each is one `EngineOption` row of SERVE_OPTIONS (the record of cpllm/engine_options.py), filling one field of
ServeOptions and taking its default from that field; the flags are generated from the table, as the engine's are.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from cpllm.engine_args import add_option_arguments, option_values
from cpllm.engine_options import EngineOption, parse_bytes
from cpllm.server.reasoning import REASONING_PARSERS

LOAD_FORMATS = ("auto", "safetensors", "gguf")
"""--load-format values: how the weights on disk are stored (auto: told by the path)."""
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""Names accepted by --tool-call-parser (vLLM's names for the same formats)."""

MAX_API_SERVERS = 64
"""Most --api-server-count processes (each is a Python interpreter with the tokenizer loaded)."""

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
    max_logprobs: int = 20
    """Largest logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's default 20); -1 allows the
    whole vocabulary, which a request asks for with -1."""
    enable_prompt_tokens_details: bool = False
    """Report prefix-cache hits in usage.prompt_tokens_details.cached_tokens (null otherwise, as vLLM)."""
    enable_force_include_usage: bool = False
    """Every streamed chunk carries the usage so far (and a last usage chunk), whatever stream_options say."""
    enable_per_request_metrics: bool = False
    """Each response with one choice carries `metrics`: the request's queue time, time to first token, decode
    time, mean inter-token latency and tokens per second (vLLM 0.33's flag); a stream on its final usage chunk."""
    enable_server_load_tracking: bool = False
    """Count generation requests in flight and serve the count at GET /load."""
    root_path: str = ""
    """A path prefix a proxy adds in front of every route (e.g. /llm): both /llm/v1/... and /v1/... are served."""
    chat_template: str | None = None
    """The chat template of requests that give none: a file's path or the Jinja text itself; None = the model's."""
    gpu_memory_utilization: float | None = None
    """vLLM's flag: the fraction of the memory available at start (a GPU's free memory, or the host's split among
    its ranks) that the KV cache takes; None = cpllm's default (a fifth, capped at what the run can fill)."""
    load_format: str = "auto"
    """How the weights are stored: auto (from the path), safetensors or gguf; checked against the model path."""
    trust_remote_code: bool = False
    """Accepted: cpllm runs the architectures it implements itself and never executes a model's own code."""
    disable_frontend_multiprocessing: bool = False
    """Accepted: with one API server the HTTP front runs in the engine's driver process already."""
    enable_log_requests: bool = False
    """Log each generation request as it arrives: its id, prompt sizes and sampling parameters."""
    reasoning_parser: str | None = None
    """Split the model's thinking into message.reasoning / reasoning_content: one of REASONING_PARSERS."""
    api_server_count: int = 1
    """HTTP server processes on the one port: 1 serves HTTP in the engine's own process; N > 1 runs the engine in
    this process and N API-server processes in front of it (cpllm/server/api_servers.py)."""

    def __post_init__(self) -> None:
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be >= 1024, got {self.max_request_body_bytes}")
        for name, flag in (("max_n", "--max-n"), ("retry_after_s", "--retry-after")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(f"--shutdown-timeout must be in [0, 3600] seconds, got {self.shutdown_timeout_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one (e.g. /llm), got "
                             f"{self.root_path!r}")
        self._check_vllm_flags()

    def _check_vllm_flags(self) -> None:
        """vLLM's deployment flags: each does what it says here, or is refused naming itself and why."""
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format!r} is not supported (cpllm reads real weights: one "
                             f"of {', '.join(LOAD_FORMATS)})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not supported; the parsers built are "
                             f"{', '.join(REASONING_PARSERS)}")
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            raise ValueError(f"--api-server-count must be in [1, {MAX_API_SERVERS}], got {self.api_server_count}")
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", _template_text(self.chat_template))

    def body_limit(self, max_model_len: int) -> int:
        """The body limit in bytes for a server of this max_model_len."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def _serve_option(name: str, type_: type, field: str, **more) -> EngineOption:
    return EngineOption(name, type_, field, record=ServeOptions, **more)


SERVE_OPTIONS: tuple[EngineOption, ...] = (
    _serve_option("max_request_body_bytes", int, "max_request_body_bytes", parse=parse_bytes,
                  help="413 for larger bodies, before parsing (default: max(1MiB, 32 B x max_model_len))"),
    _serve_option("max_n", int, "max_n", help="largest n per request (default: %(default)s)"),
    _serve_option("max_queued_requests", int, "max_queued_requests",
                  help="sequences (prompts x n) allowed to wait beyond --max-num-seqs; then 429 with Retry-After "
                       "(default: %(default)s)"),
    _serve_option("retry_after", int, "retry_after_s", metavar="SECONDS",
                  help="seconds a 429 response's Retry-After header asks the client to wait (default: %(default)s)"),
    _serve_option("shutdown_timeout", float, "shutdown_timeout_s", metavar="SECONDS",
                  help="after SIGTERM, how long requests in flight may finish before each is ended with an error "
                       "event; the process exits about a second later (default: %(default)s, inside Kubernetes' "
                       "30 s grace period)"),
    _serve_option("enable_auto_tool_choice", bool, "enable_auto_tool_choice",
                  help='parse tool calls from the model\'s output for tool_choice="auto"'),
    _serve_option("tool_call_parser", str, "tool_call_parser", choices=TOOL_CALL_PARSERS,
                  help="the model's tool-call format (hermes: <tool_call>{...}</tool_call>, as Qwen and Hermes "
                       "models write; llama3_json: {\"name\": ..., \"parameters\": ...})"),
    _serve_option("max_logprobs", int, "max_logprobs",
                  help="largest logprobs / top_logprobs / prompt_logprobs per request; -1 allows the whole "
                       "vocabulary, which a request asks for with -1 (default: %(default)s)"),
    _serve_option("enable_prompt_tokens_details", bool, "enable_prompt_tokens_details",
                  help="report prefix-cache hits in usage.prompt_tokens_details.cached_tokens"),
    _serve_option("enable_force_include_usage", bool, "enable_force_include_usage",
                  help="every streamed chunk carries the usage so far, whatever stream_options say"),
    _serve_option("enable_per_request_metrics", bool, "enable_per_request_metrics",
                  help="responses with one choice carry `metrics` (queue, TTFT, decode time, mean ITL, tokens/s); "
                       "a stream on its final usage chunk"),
    _serve_option("enable_server_load_tracking", bool, "enable_server_load_tracking",
                  help="count generation requests in flight, served at GET /load"),
    _serve_option("root_path", str, "root_path", metavar="PATH",
                  help="a prefix a proxy puts before every route (e.g. /llm): /llm/v1/... and /v1/... both work"),
    _serve_option("chat_template", str, "chat_template", metavar="FILE_OR_TEMPLATE",
                  help="chat template for requests that give none: a file, or the Jinja text (default: the "
                       "model's)"),
    _serve_option("gpu_memory_utilization", float, "gpu_memory_utilization", metavar="FRACTION",
                  help="fraction of the memory available at start that the KV cache takes (a GPU's free memory; "
                       "on the CPU the host's, split among its ranks); default: a fifth, capped at what "
                       "max_num_seqs x max_model_len can fill"),
    _serve_option("load_format", str, "load_format",
                  help=f"weights' format: {', '.join(LOAD_FORMATS)} (checked against the model path; vLLM's "
                       "others, such as dummy, are refused) (default: %(default)s)"),
    _serve_option("trust_remote_code", bool, "trust_remote_code",
                  help="accepted: cpllm implements its architectures itself and never runs a model's own code"),
    _serve_option("disable_frontend_multiprocessing", bool, "disable_frontend_multiprocessing",
                  help="accepted: the HTTP front always runs in the engine's driver process"),
    _serve_option("enable_log_requests", bool, "enable_log_requests",
                  help="log each generation request on arrival (id, prompt tokens, sampling parameters)"),
    _serve_option("reasoning_parser", str, "reasoning_parser", metavar="NAME",
                  help="split the thinking (<think>...</think>) into message.reasoning / reasoning_content: "
                       f"{' or '.join(REASONING_PARSERS)} (default: none, the thinking stays in the content)"),
    _serve_option("api_server_count", int, "api_server_count", metavar="N",
                  help="HTTP server processes sharing the port in front of one engine; /metrics sums them "
                       "(default: %(default)s: HTTP in the engine's own process)"),
)
"""The server's flags, one row per ServeOptions field (vLLM's names where vLLM has the option); a flag's default
is its field's."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ServeOptions, generated from SERVE_OPTIONS."""
    add_option_arguments(parser, "server limits and tools", SERVE_OPTIONS)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed flags (validated: a bad value raises ValueError naming its flag)."""
    return ServeOptions(**option_values(args, SERVE_OPTIONS))


def _template_text(value: str) -> str:
    """--chat-template's text: the file's when it names one, else the value itself if it is a Jinja template."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def served_model_name(args: argparse.Namespace, model_path: str) -> str:
    """--served-model-name, else the model argument as given, else the default model's file name."""
    if args.served_model_name:
        return args.served_model_name
    given = args.model_path or args.model
    if given:
        return given
    name = os.path.basename(model_path)
    return name.removesuffix(".gguf")

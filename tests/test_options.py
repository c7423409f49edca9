"""One table of engine options (cpllm/engine_options.py): the CLI, `LLM(...)` and the config agree on every option.

No process starts: `build_engine_config` reads only the tiny model's config.json.
"""

from __future__ import annotations

import inspect

import pytest

from cpllm.cli import build_parser
from cpllm.config.speculative import speculative_config
from cpllm.disagg.config import kv_transfer_config
from cpllm.engine.llm import LLM, build_engine_config
from cpllm.engine_args import engine_flags, engine_kwargs
from cpllm.engine_options import CONFIG_OPTIONS, ENGINE_OPTIONS, OPTIONS, config_field_default, resolve_options
from tiny_models import save_tiny_hf_model

COMMANDS = (["generate", "--prompt", "hi"], ["serve"], ["bench", "decode"])

CHANGED: dict[str, tuple[list[str], object, dict]] = {
    "dtype": (["--dtype", "bfloat16"], "bfloat16", {}),
    "quantization": (["-q", "none"], "none", {}),
    "block_size": (["--block-size", "8"], 8, {}),
    "max_model_len": (["--max-model-len", "128"], 128, {}),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512, {}),
    "max_num_seqs": (["--max-num-seqs", "3"], 3, {}),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False, {}),
    "state_snapshots": (["--state-snapshots", "4"], 4, {}),  # the tiny Llama has no state layers: refused
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "1MiB"], 2**20, {}),
    "kv_cache_dtype": (["--kv-cache-dtype", "float16"], "float16", {}),
    "seed": (["--seed", "7"], 7, {}),
    "tensor_parallel_size": (["-tp", "2"], 2, {}),
    "prefill_context_parallel_size": (["-pcp", "2"], 2, {}),
    "decode_context_parallel_size": (["-dcp", "2"], 2, {"tensor_parallel_size": 4}),  # 2 KV heads over 4 ranks
    "data_parallel_size": (["-dp", "3"], 3, {}),
    "cp_kv_cache_interleave_size": (["--cp-kv-cache-interleave-size", "4"], 4, {}),
    "cp_prefill_strategy": (["--cp-prefill-strategy", "ring"], "ring", {}),
    "cp_kv_cache_layout": (["--cp-kv-cache-layout", "replicated"], "replicated", {}),
    "enable_expert_parallel": (["--enable-expert-parallel"], True, {}),
    "compile_decode": (["--compile-decode"], True, {}),
    "enforce_eager": (["--enforce-eager"], True, {}),
    "speculative_config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                           {"method": "ngram", "num_speculative_tokens": 3}, {}),
    "kv_transfer_config": (["--kv-transfer-config", '{"kv_connector": "CpllmConnector", "kv_role": "kv_both", '
                            '"engine_id": "e1", "kv_port": 23000}'],
                           {"kv_connector": "CpllmConnector", "kv_role": "kv_both", "engine_id": "e1",
                            "kv_port": 23000}, {}),
    "distributed_timeout": (["--distributed-timeout", "5.5"], 5.5, {}),
    "collective_transport": (["--collective-transport", "gloo"], "gloo", {}),
    "threads_per_rank": (["--threads-per-rank", "2"], 2, {}),
    "max_replica_restarts": (["--max-replica-restarts", "5"], 5, {}),
}
"""option -> (flags that change it, the value they give, other options the value needs)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The default tiny Llama: 4 heads, 2 KV heads, 256 positions."""
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=0)


def llm_defaults() -> dict[str, object]:
    return {name: p.default for name, p in inspect.signature(LLM).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0] + (c[1] if c[0] == "bench" else ""))
def test_cli_defaults_are_the_llm_defaults(command):
    args = build_parser().parse_args(command)
    llm, resolved = llm_defaults(), resolve_options({}, "LLM")
    for option in ENGINE_OPTIONS:
        assert getattr(args, option.name) is llm[option.name] is resolved[option.name] is option.default, option.name
    assert engine_kwargs(args).keys() == llm.keys() == OPTIONS.keys()


def test_config_options_default_to_their_config_field():
    """An option that fills a config field has that field's default, or None ("the field's own default", or for
    max_model_len the model's), so the dataclass, the CLI and LLM cannot disagree."""
    for option in CONFIG_OPTIONS:
        assert option.default is None or option.default is config_field_default(option.fills), option.name
    assert OPTIONS["max_num_batched_tokens"].default is None
    assert config_field_default("scheduler.max_num_batched_tokens") == 8192


def test_every_option_is_in_the_table_test():
    assert CHANGED.keys() == OPTIONS.keys(), "give the new option a row in CHANGED"


@pytest.mark.parametrize("name", list(CHANGED))
def test_every_option_reaches_the_engine_from_the_cli_and_from_llm(folder, name):
    flags, value, needs = CHANGED[name]
    option = OPTIONS[name]
    for command in COMMANDS:
        assert engine_kwargs(build_parser().parse_args([*command, *flags]))[name] == value, (command, flags)
    assert name in inspect.signature(LLM).parameters
    if option.fills is None:  # acts at launch: not a config option
        with pytest.raises(TypeError, match=name):
            build_engine_config(folder, **{name: value})
        return
    if name == "state_snapshots":  # reaches the config, which refuses it on a model without state layers
        with pytest.raises(ValueError, match="state_snapshots=4 applies .* no state layers"):
            build_engine_config(folder, **{name: value})
        return  # filled on a hybrid: tests/test_qwen3_5_prefix_spec.py
    config = build_engine_config(folder, **needs, **{name: value})
    section, field = option.fills.split(".")
    filled = config if section == "engine" else getattr(config, section)
    if name == "speculative_config":  # the dict is validated into its frozen config
        value = speculative_config(value, config.model.vocab_size)
    if name == "kv_transfer_config":  # likewise (cpllm/disagg/config.py)
        value = kv_transfer_config(value)
    assert getattr(filled, field) == value


def test_defaults_fill_the_config(folder):
    config = build_engine_config(folder)
    assert config.scheduler.max_num_batched_tokens == 8192
    assert config.scheduler.max_model_len == config.model.max_position_embeddings == 256
    assert config.parallel.distributed_timeout_s == 120.0 and config.cache.block_size == 16


@pytest.mark.parametrize("flags, values", [
    (["-tp", "0"], ["tensor_parallel_size", "0", ">= 1"]),
    (["--max-num-seqs", "0"], ["max_num_seqs", "0", ">= 1"]),
    (["--block-size", "-4"], ["block_size", "-4", ">= 1"]),
    (["--distributed-timeout", "0"], ["distributed_timeout_s", "0", "> 0"]),
    (["--kv-cache-memory-bytes", "0"], ["kv_cache_memory_bytes", "0", "> 0"]),
    (["--max-model-len", "1000"], ["max_model_len=1000", "max_position_embeddings=256"]),
    (["--cp-kv-cache-interleave-size", "32"], ["cp_kv_cache_interleave_size=32", "block_size=16"]),
])
def test_a_bad_value_names_the_value_and_the_limit(folder, flags, values):
    """The same message whether the value came from the command line or from LLM(...) keywords."""
    from_cli = engine_kwargs(build_parser().parse_args(["serve", *flags]))
    del from_cli["threads_per_rank"], from_cli["max_replica_restarts"]
    name = next(option.name for option in ENGINE_OPTIONS if option.flag in flags or option.short in flags)
    for options in (from_cli, {name: from_cli[name]}):
        with pytest.raises(ValueError) as error:
            build_engine_config(folder, **options)
        for value in values:
            assert value in str(error.value), (value, str(error.value))


def test_a_value_outside_the_choices_is_refused_by_the_cli(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    message = capsys.readouterr().err
    assert "'fp8'" in message and "bfloat16" in message


def test_an_unknown_keyword_is_refused_naming_it_and_the_closest_option(folder):
    with pytest.raises(TypeError, match=r"LLM\(\) got an unknown engine option 'tensor_paralel_size'; did you mean "
                                        r"'tensor_parallel_size'\?"):
        LLM(folder, tensor_paralel_size=2)
    with pytest.raises(TypeError, match="unknown engine option 'threads_per_rank'"):
        build_engine_config(folder, threads_per_rank=2)


def test_changed_options_spell_back_as_flags_that_parse_to_the_same_options():
    """`cpllm bench serve` starts its server with the flags of the options it was given."""
    given = ["--model", "m.gguf", "-tp", "2", "--no-enable-prefix-caching", "--compile-decode",
             "--kv-cache-memory-bytes", "1MiB", "--distributed-timeout", "5.5", "--dcp-kv-cache-interleave-size", "4"]
    with pytest.warns(Warning, match="deprecated"):
        args = build_parser().parse_args(["bench", "serve", *given])
    flags = engine_flags(args)
    assert flags[:2] == ["--model", "m.gguf"] and "--no-enable-prefix-caching" in flags
    assert "--compile-decode" in flags and "True" not in flags  # an on/off flag takes no value
    again = build_parser().parse_args(["serve", *flags])
    assert engine_kwargs(again) == engine_kwargs(args) and again.model == "m.gguf"
    assert engine_flags(build_parser().parse_args(["serve"])) == []


SERVE_CHANGED: dict[str, tuple[list[str], object]] = {
    "max_request_body_bytes": (["--max-request-body-bytes", "64KiB"], 64 * 2**10),
    "max_n": (["--max-n", "4"], 4),
    "max_queued_requests": (["--max-queued-requests", "0"], 0),
    "retry_after": (["--retry-after", "7"], 7),
    "shutdown_timeout": (["--shutdown-timeout", "2.5"], 2.5),
    "enable_auto_tool_choice": (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], True),
    "tool_call_parser": (["--tool-call-parser", "llama3_json"], "llama3_json"),
    "max_logprobs": (["--max-logprobs", "5"], 5),
    "enable_prompt_tokens_details": (["--enable-prompt-tokens-details"], True),
    "enable_force_include_usage": (["--enable-force-include-usage"], True),
    "enable_server_load_tracking": (["--enable-server-load-tracking"], True),
    "root_path": (["--root-path", "/llm"], "/llm"),
    "chat_template": (["--chat-template", "{{ messages }}"], "{{ messages }}"),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "load_format": (["--load-format", "gguf"], "gguf"),
    "trust_remote_code": (["--trust-remote-code"], True),
    "disable_frontend_multiprocessing": (["--disable-frontend-multiprocessing"], True),
    "enable_log_requests": (["--enable-log-requests"], True),
    "reasoning_parser": (["--reasoning-parser", "no_such_parser"], ValueError),
    "api_server_count": (["--api-server-count", "2"], 2),
    "enable_per_request_metrics": (["--enable-per-request-metrics"], True),
}
"""server option -> (flags that change it, the value its ServeOptions field gets, or ValueError for a vLLM flag
refused naming itself)."""


def test_every_server_field_has_one_flag_whose_default_is_the_field_default():
    from dataclasses import fields

    from cpllm.engine_options import record_field_default
    from cpllm.server.options import SERVE_OPTIONS, ServeOptions, serve_options

    assert sorted(option.fills for option in SERVE_OPTIONS) == sorted(f.name for f in fields(ServeOptions))
    assert SERVE_CHANGED.keys() == {option.name for option in SERVE_OPTIONS}, "give the new option a SERVE_CHANGED row"
    args = build_parser().parse_args(["serve"])
    for option in SERVE_OPTIONS:
        assert getattr(args, option.name) is option.default is record_field_default(ServeOptions, option.fills), \
            option.name
    assert serve_options(args) == ServeOptions()


@pytest.mark.parametrize("name", list(SERVE_CHANGED))
def test_every_server_flag_reaches_its_field(name):
    from cpllm.server.options import SERVE_OPTIONS, serve_options

    flags, value = SERVE_CHANGED[name]
    option = next(option for option in SERVE_OPTIONS if option.name == name)
    args = build_parser().parse_args(["serve", *flags])
    if value is ValueError:
        with pytest.raises(ValueError, match=option.flag):
            serve_options(args)
        return
    assert getattr(serve_options(args), option.fills) == value


def test_retry_after_has_a_flag_and_a_bad_value_names_it():
    from cpllm.server.options import serve_options

    assert serve_options(build_parser().parse_args(["serve", "--retry-after", "3"])).retry_after_s == 3
    with pytest.raises(ValueError, match="--retry-after must be >= 1, got 0"):
        serve_options(build_parser().parse_args(["serve", "--retry-after", "0"]))


def test_generate_sampling_defaults_are_sampling_params_defaults_but_the_documented_ones():
    """Each sampling flag of `generate` defaults to its SamplingParams field, except GENERATE_DEFAULTS, whose help
    names SamplingParams' own default."""
    from cpllm.cli_generate import GENERATE_DEFAULTS, SAMPLING_OPTIONS, sampling_params
    from cpllm.engine.sampling_params import SamplingParams
    from cpllm.engine_options import record_field_default

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    for option in SAMPLING_OPTIONS:
        field_default = record_field_default(SamplingParams, option.fills)
        assert getattr(args, option.name) == option.default, option.name
        if option.fills in GENERATE_DEFAULTS:
            assert option.default == GENERATE_DEFAULTS[option.fills] != field_default, option.name
            assert f"SamplingParams' is {field_default}" in option.help, option.name
        else:
            assert option.default is field_default, option.name
    assert sampling_params(args) == SamplingParams(**GENERATE_DEFAULTS)
    given = build_parser().parse_args(["generate", "--prompt", "hi", "--request-seed", "5", "--stop", "a", "--stop",
                                       "b", "--top-k", "3", "--ignore-eos"])
    assert sampling_params(given) == SamplingParams(**GENERATE_DEFAULTS, seed=5, stop=["a", "b"], top_k=3,
                                                    ignore_eos=True)


def test_bench_engines_run_the_table_defaults(folder, monkeypatch):
    """build_llm (the Python API of `cpllm bench`) sets its layout, strategy and prefix caching, sizes what the
    caller left None, and leaves every other option at the table's default: the engine the CLI's flags build."""
    from cpllm.bench import engines
    from cpllm.bench.common import BenchLayout

    built = {}
    monkeypatch.setattr(engines, "LLM", lambda model, **options: built.update(options) or "llm")
    layout = BenchLayout.of(tp=1, pcp=2, dcp=1)
    llm, threads = engines.build_llm(folder, layout, strategy=None, threads_per_rank=1, context_tokens=64,
                                     batch_tokens=32)
    assert llm == "llm" and threads == 1 and built.keys() == OPTIONS.keys()
    sized = {"kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens", "threads_per_rank"}
    for name, option in OPTIONS.items():
        if name not in sized and name not in engines.BENCH_SETS:
            assert built[name] == option.default, name
    assert built["distributed_timeout"] == config_field_default("parallel.distributed_timeout_s") == 120.0
    assert (built["prefill_context_parallel_size"], built["cp_prefill_strategy"], built["enable_prefix_caching"],
            built["max_model_len"], built["max_num_batched_tokens"]) == (2, "allgather", False, 64, 32)
    engines.build_llm(folder, layout, strategy="ring", threads_per_rank=1, context_tokens=64, batch_tokens=32,
                      engine_options={"model": folder, "distributed_timeout": 9.0, "max_model_len": 48})
    assert (built["distributed_timeout"], built["max_model_len"], built["cp_prefill_strategy"]) == (9.0, 48, "ring")
    with pytest.raises(TypeError, match="build_llm\\(\\) got an unknown engine option 'distributed_timeout_s'"):
        engines.build_llm(folder, layout, strategy=None, threads_per_rank=1, context_tokens=64, batch_tokens=32,
                          engine_options={"distributed_timeout_s": 9.0})

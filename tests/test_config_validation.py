"""Unsupported combinations are refused when the engine is configured, with the bad values in the message.

No process starts here: `build_engine_config` reads only config.json (the
weights of a variant folder are the base model's and are never loaded), and the
CLI checks parse `cpllm.cli.build_parser()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections import Counter

import pytest

from cpllm.cli import build_parser
from cpllm.config.engine import ModelConfig, ParallelConfig
from cpllm.distributed.parallel_dims import kv_heads_of_tp_rank, valid_dcp_sizes
from cpllm.engine.llm import build_engine_config
from cpllm.engine_args import engine_kwargs
from tiny_models import save_tiny_hf_model


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> str:
    """The default tiny Llama: 4 heads, 2 KV heads, 256 positions."""
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("base")), "llama", seed=0)


@pytest.fixture(scope="module")
def variant(base_folder, tmp_path_factory):
    """variant(**config_changes) -> a copy of the base folder whose config.json has the changes applied."""
    count = 0

    def make(**changes) -> str:
        nonlocal count
        count += 1
        folder = str(tmp_path_factory.mktemp(f"variant{count}"))
        shutil.copytree(base_folder, folder, dirs_exist_ok=True)
        path = os.path.join(folder, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config.update(changes)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        return folder

    return make


def refused(folder: str, *values, **options) -> str:
    """build_engine_config must raise ValueError quoting every one of `values`; returns the message."""
    with pytest.raises(ValueError) as error:
        build_engine_config(folder, **options)
    message = str(error.value)
    for value in values:
        assert str(value) in message, f"{value!r} missing from: {message}"
    return message


# ---- parallel sizes against the model --------------------------------------------------------------


def test_valid_layouts_are_accepted(base_folder, variant):
    kv1 = variant(num_key_value_heads=1)
    config = build_engine_config(base_folder, tensor_parallel_size=4)  # 2 KV heads replicated over 4 ranks
    assert config.parallel.dims.world_size == 4
    config = build_engine_config(base_folder, tensor_parallel_size=4, decode_context_parallel_size=2,
                                 prefill_context_parallel_size=2, data_parallel_size=2, block_size=8,
                                 cp_kv_cache_interleave_size=8, cp_prefill_strategy="ring")
    assert (config.parallel.dims.world_size, config.parallel.dims.cp_size) == (16, 4)
    config = build_engine_config(kv1, tensor_parallel_size=2, decode_context_parallel_size=2)
    assert config.parallel.dims.cp_size == 2


def test_tp_must_divide_attention_heads(base_folder):
    refused(base_folder, "num_attention_heads=4", "tensor_parallel_size=3", tensor_parallel_size=3)


def test_tp_must_divide_kv_heads_when_they_are_split(variant):
    folder = variant(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    refused(folder, "num_key_value_heads=3", "tensor_parallel_size=2", tensor_parallel_size=2)


def test_tp_must_be_a_multiple_of_kv_heads_when_they_are_replicated(variant):
    folder = variant(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    refused(folder, "tensor_parallel_size=3", "num_key_value_heads=2", tensor_parallel_size=3)


def test_dcp_must_divide_tp(base_folder):
    refused(base_folder, "decode_context_parallel_size=3", "tensor_parallel_size=4",
            tensor_parallel_size=4, decode_context_parallel_size=3)


@pytest.mark.parametrize(("tp", "dcp", "valid"), [(2, 2, "[1]"), (4, 4, "[1, 2]")])
def test_dcp_group_must_not_mix_kv_heads(base_folder, tp, dcp, valid):
    # 2 KV heads: TP=2 gives each rank its own head, TP=4 replicates each head on 2 ranks only.
    message = refused(base_folder, f"decode_context_parallel_size={dcp}", f"tensor_parallel_size={tp}",
                      "num_key_value_heads=2", tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    assert f"Valid DCP sizes here: {valid}" in message


def test_dcp_counter_example_tp6_kv2_is_refused(variant):
    # DCP <= TP // kv_heads (2 <= 3) holds, yet the DCP group of TP ranks {2, 3} holds KV heads 0 and 1.
    folder = variant(num_attention_heads=12, num_key_value_heads=2, hidden_size=192, intermediate_size=192)
    message = refused(folder, "decode_context_parallel_size=2", "tensor_parallel_size=6", "num_key_value_heads=2",
                      tensor_parallel_size=6, decode_context_parallel_size=2)
    assert "TP ranks [2, 3]" in message and "KV heads [0, 1]" in message


def brute_force_dcp_ok(tp: int, kv_heads: int, dcp: int) -> bool:
    """Place KV heads over TP ranks from first principles and look at every DCP group."""
    if kv_heads >= tp:
        held = [frozenset(range(t * kv_heads // tp, (t + 1) * kv_heads // tp)) for t in range(tp)]
    else:
        copies = tp // kv_heads  # each head lives on `copies` consecutive ranks
        held = [frozenset([t // copies]) for t in range(tp)]
    return all(len(set(held[g : g + dcp])) == 1 for g in range(0, tp, dcp))


def placeable(tp: int, kv_heads: int) -> bool:
    return kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0


ENUMERATED = [(tp, kv, dcp) for tp in range(1, 9) for kv in (1, 2, 3, 4, 8) if placeable(tp, kv)
              for dcp in range(1, tp + 1) if tp % dcp == 0]


def test_dcp_rule_matches_brute_force_placement():
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=840, intermediate_size=840,
                        num_hidden_layers=1, num_attention_heads=840, num_key_value_heads=1, head_dim=1)  # 840 = lcm(1..8)
    accepted, refused_layouts = [], []
    for tp, kv, dcp in ENUMERATED:
        shaped = dataclasses.replace(model, num_key_value_heads=kv)
        parallel = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
        try:
            parallel.dims.validate(shaped)
            accepted.append((tp, kv, dcp))
        except ValueError as error:
            assert f"decode_context_parallel_size={dcp}" in str(error)
            refused_layouts.append((tp, kv, dcp))
        assert ((tp, kv, dcp) in accepted) == brute_force_dcp_ok(tp, kv, dcp), (tp, kv, dcp)
        assert ((tp, kv, dcp) in accepted) == (dcp in valid_dcp_sizes(tp, kv)), (tp, kv, dcp)
    assert (6, 2, 2) in refused_layouts and (6, 2, 3) in accepted and (8, 2, 4) in accepted
    assert (8, 2, 8) in refused_layouts and (4, 4, 2) in refused_layouts


def test_engine_placement_is_the_validated_placement():
    """The model cuts KV heads with the same function the validation reasons about."""
    for tp, kv, _ in ENUMERATED:
        for t in range(tp):
            first, count = kv_heads_of_tp_rank(kv, tp, t)
            expected = range(t * kv // tp, (t + 1) * kv // tp) if kv >= tp else range(t // (tp // kv), t // (tp // kv) + 1)
            assert range(first, first + count) == expected


def test_intermediate_size_must_divide_tp(variant):
    folder = variant(intermediate_size=66)
    refused(folder, "intermediate_size=66", "tensor_parallel_size=4", tensor_parallel_size=4)


def test_prefix_caching_default_is_on_for_attention_models(base_folder):
    """Left unset, prefix caching resolves to on for a model whose layers all cache K/V (a hybrid's is off: its
    test is in tests/test_qwen3_5_vs_hf.py); set, it is what was asked."""
    assert build_engine_config(base_folder).cache.enable_prefix_caching is True
    assert build_engine_config(base_folder, enable_prefix_caching=False).cache.enable_prefix_caching is False


@pytest.mark.parametrize("interleave", [3, 8])
def test_interleave_must_divide_block_size(base_folder, interleave):
    refused(base_folder, f"cp_kv_cache_interleave_size={interleave}", "block_size=4",
            block_size=4, cp_kv_cache_interleave_size=interleave, prefill_context_parallel_size=2)


def test_unknown_prefill_strategy(base_folder):
    message = refused(base_folder, "'ringg'", prefill_context_parallel_size=2, cp_prefill_strategy="ringg")
    assert "allgather" in message and "ring" in message


@pytest.mark.parametrize("option", [
    "tensor_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size", "data_parallel_size",
    "cp_kv_cache_interleave_size", "block_size", "max_num_seqs",
])
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_below_one(base_folder, option, value):
    refused(base_folder, option, value, **{option: value})


@pytest.mark.parametrize("option", ["max_model_len", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_scheduler_limits_below_one(base_folder, option, value):
    # 0 is a bad value like -1, not "use the default".
    refused(base_folder, option, value, **{option: value})


@pytest.mark.parametrize(("option", "value"), [("kv_cache_memory_bytes", 0), ("distributed_timeout", 0.0)])
def test_non_positive_memory_and_timeout(base_folder, option, value):
    refused(base_folder, value, **{option: value})


# ---- model and dtype ------------------------------------------------------------------------------


def test_max_model_len_beyond_the_model(base_folder):
    refused(base_folder, "max_model_len=512", "max_position_embeddings=256", max_model_len=512)
    assert build_engine_config(base_folder, max_model_len=256).scheduler.max_model_len == 256


def test_unknown_dtype(base_folder):
    refused(base_folder, "'float64'", dtype="float64")


def test_unsupported_architecture(variant):
    refused(variant(architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel'")


@pytest.mark.parametrize("pcp", [1, 2])
def test_mistral_sliding_window_slides_every_layer(variant, pcp):
    folder = variant(architectures=["MistralForCausalLM"], sliding_window=128)
    model = build_engine_config(folder, prefill_context_parallel_size=pcp).model
    assert (model.sliding_window, model.layer_types) == (128, ("sliding_attention",) * 2)


@pytest.mark.parametrize("window", [0, -3])
def test_sliding_window_below_one(variant, window):
    refused(variant(architectures=["MistralForCausalLM"], sliding_window=window), f"sliding_window={window}")


def test_mistral_window_as_long_as_the_context_is_no_window(variant):
    folder = variant(architectures=["MistralForCausalLM"], sliding_window=256)
    assert build_engine_config(folder, prefill_context_parallel_size=2).model.sliding_window is None


@pytest.mark.parametrize("pcp", [1, 2])
def test_qwen2_layers_from_max_window_layers_slide(variant, pcp):
    # no layer_types in the file: layers i >= max_window_layers slide, as transformers' Qwen2Config decides
    folder = variant(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                     max_window_layers=1)
    model = build_engine_config(folder, prefill_context_parallel_size=pcp).model
    assert (model.sliding_window, model.layer_types) == (64, ("full_attention", "sliding_attention"))


def test_qwen2_layer_types_win_over_max_window_layers(variant):
    folder = variant(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                     max_window_layers=0, layer_types=["sliding_attention", "full_attention"])
    assert build_engine_config(folder).model.layer_types == ("sliding_attention", "full_attention")


def test_window_of_a_family_without_windows_refused(variant):
    folder = variant(architectures=["LlamaForCausalLM"], sliding_window=64)
    refused(folder, "sliding_window=64", "LlamaForCausalLM")


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("arch, fields, expected", [
    ("MixtralForCausalLM", dict(sliding_window=64), (64, (S, S, S))),
    ("MixtralForCausalLM", dict(sliding_window=None), (None, ())),
    ("MixtralForCausalLM", dict(sliding_window=256), (None, ())),  # as long as the context: no window
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), (64, (F, S, S))),
    ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=64, max_window_layers=1), (None, ())),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64, layer_types=[S, F, S]), (64, (S, F, S))),
    ("Qwen3ForCausalLM", dict(sliding_window=64), (None, ())),  # use_sliding_window defaults to false
    # transformers' Qwen3-MoE reads neither max_window_layers nor layer_types: its window covers every layer
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2,
                                 layer_types=[F, F, F]), (64, (S, S, S))),
    ("Qwen3MoeForCausalLM", dict(sliding_window=64), (None, ())),
])
def test_windowed_layers_of_mixtral_and_qwen3(arch, fields, expected):
    from cpllm.config.attention import hf_layer_types

    cfg = dict(architectures=[arch], num_hidden_layers=3, max_position_embeddings=256, **fields)
    assert hf_layer_types(arch, cfg) == expected


def test_gemma3_config_of_transformers_4(variant):
    """The older spelling: rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern, no
    layer_types (every pattern-th layer full)."""
    folder = variant(architectures=["Gemma3ForCausalLM"], rope_parameters=None, rope_theta=1e6,
                     rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                     sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=32)
    model = build_engine_config(folder).model
    assert (model.layer_types, model.sliding_window) == (("sliding_attention", "full_attention"), 16)
    assert (model.rope_theta, model.rope_local_theta, model.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert (model.query_pre_attn_scalar, model.qk_norm, model.hidden_activation) == (32, True, "gelu_pytorch_tanh")


def test_gemma2_without_layer_types_alternates(variant):
    folder = variant(architectures=["Gemma2ForCausalLM"], sliding_window=16, attn_logit_softcapping=50.0)
    model = build_engine_config(folder).model
    assert model.layer_types == ("sliding_attention", "full_attention") and model.attn_logit_softcapping == 50.0


def test_gemma2_keys_left_out_take_transformers_defaults(variant):
    model = build_engine_config(variant(architectures=["Gemma2ForCausalLM"])).model
    assert (model.sliding_window, model.attn_logit_softcapping, model.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert model.layer_types == ("sliding_attention", "full_attention") and model.query_pre_attn_scalar == 256


def test_gemma_refusals(variant):
    refused(variant(architectures=["Gemma2ForCausalLM"], use_bidirectional_attention=True),
            "use_bidirectional_attention=True")
    refused(variant(architectures=["Gemma2ForCausalLM"], hidden_activation="gelu"), "hidden_activation='gelu'")
    refused(variant(architectures=["Gemma3ForCausalLM"], rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}), "'linear'")


def test_compile_decode_refused_with_windows_and_gemma(variant):
    mistral = variant(architectures=["MistralForCausalLM"], sliding_window=128)
    refused(mistral, "compile_decode=True", "sliding_window=128", "max_model_len=256", compile_decode=True)
    # a window no shorter than max_model_len hides nothing: the compiled step runs
    assert build_engine_config(mistral, compile_decode=True, max_model_len=128).compile_decode
    refused(variant(architectures=["Gemma2ForCausalLM"], sliding_window=512), "Gemma2ForCausalLM",
            compile_decode=True)


def test_gemma_fields_refused_elsewhere(base_folder):
    model = build_engine_config(base_folder).model
    for name, value in (("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 256), ("rope_local_theta", 1e4)):
        with pytest.raises(ValueError, match=f"{name}={value}.*LlamaForCausalLM"):
            dataclasses.replace(model, **{name: value})


def test_qwen2_unused_sliding_window_is_accepted(variant):
    # Qwen2 configs carry a sliding_window value even when use_sliding_window is off.
    folder = variant(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=64)
    assert build_engine_config(folder, prefill_context_parallel_size=2).model.sliding_window is None


# ---- command line ---------------------------------------------------------------------------------

PARALLEL_OPTIONS = {
    "-tp": "--tensor-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-dp": "--data-parallel-size",
}


def listed_options(help_text: str) -> list[list[str]]:
    """The option strings of each entry of an argparse help text (the usage summary left out)."""
    body = help_text.split("\n\n", 1)[1]
    entries = []
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith("-"):
            invocation = re.split(r"\s{2,}", stripped)[0]  # "-tp N, --tensor-parallel-size N"
            entries.append([part.split(" ")[0] for part in invocation.split(", ")])
    return entries


def command_help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_parallel_options_listed_once(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    entries = listed_options(command_help(command, capsys))
    counts = Counter(option for entry in entries for option in entry)
    for short, long in PARALLEL_OPTIONS.items():
        assert counts[short] == 1 and counts[long] == 1, (short, long, counts)
        assert [short, long] in entries, f"{short} and {long} should name one option"
    assert counts["--cp-kv-cache-interleave-size"] == 1, counts


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_parallel_options_reach_the_engine(command):
    args = build_parser().parse_args([*command, "-tp", "4", "-pcp", "2", "-dcp", "2", "-dp", "3",
                                      "--cp-kv-cache-interleave-size", "8", "--cp-prefill-strategy", "ring"])
    kwargs = engine_kwargs(args)
    assert (kwargs["tensor_parallel_size"], kwargs["prefill_context_parallel_size"],
            kwargs["decode_context_parallel_size"], kwargs["data_parallel_size"]) == (4, 2, 2, 3)
    assert kwargs["cp_kv_cache_interleave_size"] == 8 and kwargs["cp_prefill_strategy"] == "ring"


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_deprecated_interleave_alias(command):
    parser = build_parser()
    with pytest.warns(Warning, match="deprecated"):
        old = parser.parse_args([*command, "--dcp-kv-cache-interleave-size", "8"])
    new = parser.parse_args([*command, "--cp-kv-cache-interleave-size", "8"])
    assert old.cp_kv_cache_interleave_size == new.cp_kv_cache_interleave_size == 8
    assert engine_kwargs(old)["cp_kv_cache_interleave_size"] == 8
    assert parser.parse_args(command).cp_kv_cache_interleave_size == 1


@pytest.mark.parametrize("value", ["0", "lots", "-64"])
def test_a_bad_int4_threshold_is_refused_at_configuration(base_folder, monkeypatch, value):
    """CPLLM_INT4_GEMM_FROM_ROWS is read with the configuration: a bad value fails before any rank loads weights."""
    monkeypatch.setenv("CPLLM_INT4_GEMM_FROM_ROWS", value)
    refused(base_folder, f"CPLLM_INT4_GEMM_FROM_ROWS='{value}'", "'never'")
    monkeypatch.setenv("CPLLM_INT4_GEMM_FROM_ROWS", "never")
    assert build_engine_config(base_folder).model_path == base_folder

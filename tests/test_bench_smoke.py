"""Fast versions of every `cpllm bench` command and of the benchmarks/ scripts, on a tiny random model.

They keep the commands from rotting; the numbers they measure are not checked (no wall-clock
assertions), but what the commands count is: FLOPs against a brute-force count, bytes moved per
layer against the formula, KV capacity against the per-rank budget, the JSON and report shapes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cpllm.bench.ceiling import linear_params_per_layer, prefill_flops
from cpllm.bench.comm_volume import formula_bytes_per_layer
from cpllm.distributed import shm_group
from cpllm.bench.common import BenchLayout, parse_layout
from cpllm.bench.prefill import layout_runs
from cpllm.bench.serve_load import percentile
from cpllm.cli import main
from cpllm.context_parallel.partition import rank_token_indices
from tiny_models import make_tiny_hf_model, save_tiny_gguf, save_tiny_hf_model, tiny_hf_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
"""K and V x 2 layers x 2 KV heads x head_dim 16 x fp32, the default tiny model."""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("bench") / "tiny"), seed=3)


def _bench(*argv: str) -> None:
    assert main(["--log-level", "WARNING", "bench", *argv]) == 0


def _read(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---- pure pieces ---------------------------------------------------------------------------------------

def test_parse_layout():
    assert parse_layout("2x2x1@3") == BenchLayout.of(tp=2, pcp=2, dcp=1, threads_per_rank=3)
    assert parse_layout("2x2x2").dims.world_size == 4
    for bad in ("1x2", "0x1x1", "1x1x1@0", "axbxc", "1x4x2"):  # 1x4x2: DCP must divide TP
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)


def test_layout_runs_pcp_one_runs_once():
    runs = layout_runs([parse_layout("1x1x1"), parse_layout("1x2x1")], ["allgather", "ring"])
    assert [(r[0].dims.pcp, r[1]) for r in runs] == [(1, None), (2, "allgather"), (2, "ring")]


def test_prefill_flops_match_a_brute_force_count():
    config = tiny_hf_config()
    model = make_tiny_hf_model()
    matmul_weights = sum(p.numel() for n, p in model.named_parameters()
                         if n.startswith("model.layers.0.") and n.endswith("proj.weight"))
    assert linear_params_per_layer(config) == matmul_weights
    tokens = 7
    heads, dim, layers = config.num_attention_heads, config.head_dim, config.num_hidden_layers
    # every causal (query, key) pair costs one D-long dot product for QK^T and one for PV
    pairs = sum(q + 1 for q in range(tokens))
    flops = prefill_flops(config, tokens, logits_rows=tokens)
    assert flops.attention == layers * heads * pairs * 2 * 2 * dim
    assert flops.linear == 2 * matmul_weights * tokens * layers
    assert flops.lm_head == 2 * config.hidden_size * config.vocab_size * tokens


@pytest.mark.parametrize("tokens,pcp", [(1, 2), (5, 2), (10, 2), (37, 4)])
def test_comm_formula_uses_the_padded_rank_size(tokens, pcp):
    config = tiny_hf_config()
    rows = max(len(rank_token_indices(tokens, pcp, r)) for r in range(pcp))
    expected = 2 * (pcp - 1) * rows * config.num_key_value_heads * config.head_dim * 4
    assert formula_bytes_per_layer(config, tokens, pcp) == expected
    assert formula_bytes_per_layer(config, tokens, 1) == 0
    # gathered in position order, rank 0 reads the other ranks' tokens only
    others = tokens - len(rank_token_indices(tokens, pcp, 0))
    assert formula_bytes_per_layer(config, tokens, pcp, in_order_rank=0) == \
        2 * others * config.num_key_value_heads * config.head_dim * 4


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None


# ---- the commands --------------------------------------------------------------------------------------

def test_bench_prefill(tiny_folder, tmp_path):
    out, png = tmp_path / "prefill.json", tmp_path / "prefill.png"
    _bench("prefill", "--model", tiny_folder, "--lengths", "9,20", "--layouts", "1x1x1,1x2x1",
           "--strategies", "allgather,ring", "--threads-per-rank", "1", "--ceiling",
           "--json", str(out), "--plot", str(png))
    data = _read(out)
    points = {(r["layout"], r["strategy"], r["prompt_tokens"]) for r in data["results"]}
    assert points == {(layout, strategy, n) for layout, strategy in
                      [("1x1x1@1", "-"), ("1x2x1@1", "allgather"), ("1x2x1@1", "ring")] for n in (9, 20)}
    assert all(r["ttft_s"] > 0 and r["threads"] == (2 if r["layout"] == "1x2x1@1" else 1) for r in data["results"])
    assert {(r["strategy"], r["prompt_tokens"]) for r in data["efficiency"]} == {
        (s, n) for s in ("allgather", "ring") for n in (9, 20)}
    assert set(data["ceilings"]) == {"1", "2"} and all("ceiling_fraction" in r for r in data["results"])
    assert png.stat().st_size > 0


def test_bench_decode(tiny_folder, tmp_path):
    out = tmp_path / "decode.json"
    _bench("decode", "--model", tiny_folder, "--batch-sizes", "1,3", "--context-lengths", "5,40",
           "--layouts", "1x1x1@1", "--steps", "3", "--shared-prefix", "--json", str(out),
           "--plot", str(tmp_path / "decode.png"))
    rows = _read(out)["results"]
    assert {(r["batch_size"], r["context_tokens"]) for r in rows} == {(b, c) for b in (1, 3) for c in (5, 40)}
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_bench_decode_rounds_rotate_the_layouts(monkeypatch):
    from cpllm.bench import decode

    ran = []

    def fake_layout(model, vocab_size, layout, round_index, **kwargs):
        ran.append((layout, round_index))
        return []

    monkeypatch.setattr(decode, "_decode_layout", fake_layout)
    monkeypatch.setattr(decode, "model_config_of", lambda model: tiny_hf_config())
    layouts = [parse_layout(x) for x in ("1x1x1@1", "1x1x1@2", "1x2x1@1")]
    decode.run_decode_bench(None, batch_sizes=[1], context_lengths=[8], layouts=layouts, rounds=3)
    assert ran == [(layout, r) for r in range(3) for layout in layouts[r:] + layouts[:r]]


def test_bench_decode_rejects_zero_rounds():
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        main(["bench", "decode", "--rounds", "0"])


def test_bench_memory_capacity_scales_with_cp(tiny_folder, tmp_path):
    out = tmp_path / "memory.json"
    budget = 64 * TINY_KV_BYTES_PER_TOKEN  # 64 tokens per rank
    _bench("memory", "--model", tiny_folder, "--cp-sizes", "1,2", "--budget", str(budget), "--json", str(out))
    one, two = _read(out)["results"]
    assert one["kv_mib_per_rank"] == two["kv_mib_per_rank"]  # the same bytes on each rank...
    assert (one["capacity_tokens"], two["capacity_tokens"]) == (64, 128)  # ...hold cp_size times the tokens
    assert (one["longest_prompt"], two["longest_prompt"]) == (63, 127)  # a prompt + its one output token
    assert [r["formula_capacity_tokens"] for r in (one, two)] == [64, 128]


def test_bench_comm_measured_equals_formula(tiny_folder, tmp_path):
    out = tmp_path / "comm.json"
    _bench("comm", "--model", tiny_folder, "--lengths", "10,33", "--json", str(out))
    rows = _read(out)["results"]
    assert {(r["strategy"], r["prompt_tokens"]) for r in rows} == {(s, n) for s in ("allgather", "ring")
                                                                   for n in (10, 33)}
    for row in rows:
        assert row["measured_bytes_per_layer"] == row["formula_bytes_per_layer"] > 0, row
        # ranks on one host gather an all-gather prefill's K/V in position order (no padding rows)
        assert row["gathered_in_order"] == (row["strategy"] == "allgather" and shm_group.available()), row


def test_bench_ceiling(tmp_path):
    out = tmp_path / "ceiling.json"
    _bench("ceiling", "--threads", "1", "--size", "128", "--json", str(out))
    (row,) = _read(out)["results"]
    assert row["threads"] == 1 and row["matmul_gflops"] > 0 and row["matvec_gbps"] > 0


@pytest.mark.skipif(importlib.util.find_spec("cpllm.server.launcher") is None,
                    reason="cpllm.server.launcher is not importable: `cpllm serve` is not available to load")
def test_bench_serve_launches_a_server(tiny_folder, tmp_path):
    out = tmp_path / "serve.json"
    _bench("serve", "--model", tiny_folder, "--threads-per-rank", "1", "--num-requests", "5", "--concurrency", "2",
           "--prompt-tokens", "8", "--output-tokens", "4", "--json", str(out), "--plot", str(tmp_path / "s.png"))
    data = _read(out)
    assert data["summary"]["num_requests"] == 5
    assert [r["output_tokens"] for r in data["requests"]] == [4] * 5  # ignore_eos: every request runs to max
    assert all(r["ttft_ms"] > 0 for r in data["requests"])


# ---- benchmarks/ scripts -------------------------------------------------------------------------------

def test_compare_script_and_report(tiny_folder, tmp_path):
    """compare.py on a tiny GGUF (llama.cpp skipped), then the report from it and a bench JSON."""
    gguf_path = str(tmp_path / "tiny.gguf")
    save_tiny_gguf(gguf_path, seed=3)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compare.py"), "--model", gguf_path,
                    "--lengths", "8,16", "--threads", "1", "--decode-contexts", "8", "--decode-batches", "1,2",
                    "--decode-steps", "2", "--skip", "llama.cpp", "--no-compiled",  # compiled: test_compiled_decode
                    "--out", str(results / "compare.json")],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    compare = _read(results / "compare.json")
    # cpllm on fp32 weights and on the GGUF's own blocks; transformers in float32 and in bfloat16
    systems = ("cpllm", "cpllm (auto)", "transformers", "transformers (bfloat16)")
    assert {(r["system"], r["prompt_tokens"]) for r in compare["prefill"]} == {
        (s, n) for s in systems for n in (8, 16)}
    # transformers decodes batch 1 only: the targets compare batches of cpllm with its batch 1
    assert {(r["system"], r["batch_size"]) for r in compare["decode"]} == {
        (s, b) for s in systems for b in (1, 2) if not s.startswith("transformers") or b == 1}
    _bench("ceiling", "--threads", "1", "--size", "64", "--json", str(results / "ceiling.json"))
    page = tmp_path / "benchmarks.md"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_report.py"), "--results", str(results),
                    "--out", str(page), "--images", str(tmp_path / "img")], check=True, env=env, capture_output=True)
    text = page.read_text()
    assert "## cpllm vs transformers vs llama.cpp" in text and "| transformers | 1 thread | 1 | 16 |" in text
    assert "_No results yet: run `benchmarks/run_all.sh prefill`._" in text
    assert (tmp_path / "img" / "compare_prefill.png").stat().st_size > 0


def test_window_bench_and_report(tmp_path):
    """benchmarks/window_bench.py (issue 31) at a tiny Gemma 3 shape (window 16): the KV each request holds comes
    from the engine's accounting, the sliding group within its window plus a block, the full group as the
    all-global model's; then the report's section from it."""
    from cpllm.kv_groups import window_blocks

    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    common = [sys.executable, os.path.join(REPO, "benchmarks", "window_bench.py"), "--shape", "tiny", "--vocab",
              "300", "--max-positions", "256", "--cache", str(tmp_path / "models")]
    for part in (["decode", "--context", "64", "--steps", "2", "--rounds", "2", "--chunk", "32"],
                 ["prefill", "--lengths", "32", "--rounds", "2"]):
        subprocess.run([*common, "--part", *part, "--out", str(results / f"window_{part[0]}.json")], check=True,
                       env=env, cwd=tmp_path, capture_output=True)
    hybrid, full = _read(results / "window_decode.json")["decode"]
    assert [g["group"] for g in hybrid["kv"]["groups"]] == ["full attention (layers 5)",
                                                           "sliding window 16 (layers 0, 1, 2, 3, 4)"]
    assert hybrid["kv"]["groups"][0]["blocks"] == full["kv"]["groups"][0]["blocks"] == 64 // 16
    assert 1 <= hybrid["kv"]["groups"][1]["blocks"] <= window_blocks(16, 16)
    assert hybrid["kv"]["bytes"] == sum(g["blocks"] * len(g["group"].split(",")) for g in hybrid["kv"]["groups"]) \
        * hybrid["kv"]["layer_block_bytes"] < full["kv"]["bytes"]
    prefill = _read(results / "window_prefill.json")["prefill"]
    assert {(r["system"], r["prompt_tokens"]) for r in prefill} == {("cpllm", 32), ("transformers", 32)}
    page = tmp_path / "benchmarks.md"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_report.py"), "--results", str(results),
                    "--out", str(page), "--images", str(tmp_path / "img")], check=True, env=env, capture_output=True)
    text = page.read_text()
    assert "## Sliding windows: Gemma 3 1B's shape (issue 31)" in text and "### KV bytes per request at 64 tokens" in text
    assert "| transformers | 1 | 32 |" in text


def test_mla_bench_and_report(tmp_path):
    """benchmarks/mla_bench.py (issue 25) at a tiny DeepSeek-V2 shape: the KV figures come from each engine's own
    accounting (DCP=2 at the same budget: half the bytes per token of a request per rank, twice the tokens), the
    two decode forms of one layer agree to float32 rounding; then the report's section from the three JSONs."""
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    common = [sys.executable, os.path.join(REPO, "benchmarks", "mla_bench.py"), "--shape", "tiny", "--vocab", "300",
              "--max-positions", "256", "--rounds", "1", "--cache", str(tmp_path / "models")]
    for part in (["dcp", "--context", "64", "--steps", "2", "--chunk", "32", "--kv-bytes", "200000"],
                 ["layer", "--contexts", "32,64"], ["prefill", "--lengths", "32"]):
        subprocess.run([*common, "--part", *part, "--out", str(results / f"mla_{part[0]}.json")], check=True,
                       env=env, cwd=tmp_path, capture_output=True)
    tp, dcp = _read(results / "mla_dcp.json")["dcp"]
    width = (32 + 16) * 4  # kv_lora_rank + rope, fp32, per layer
    assert tp["kv"]["bytes_per_token_stored"] == dcp["kv"]["bytes_per_token_stored"] == 2 * width
    assert (tp["kv"]["kv_shard_ranks"], dcp["kv"]["kv_shard_ranks"]) == (1, 2)
    assert dcp["kv"]["bytes_per_token_per_rank"] * 2 == tp["kv"]["bytes_per_token_per_rank"]
    assert dcp["kv"]["tokens_held"] == 2 * tp["kv"]["tokens_held"] == 2 * tp["kv"]["slots_per_rank"]
    layer = _read(results / "mla_layer.json")["layer"]
    assert {(r["form"], r["context_tokens"]) for r in layer} == {(f, c) for f in ("absorbed", "expanded")
                                                                 for c in (32, 64)}
    assert all(r["max_abs_diff"] <= 1e-4 * max(1.0, r["max_abs_out"]) for r in layer)
    prefill = _read(results / "mla_prefill.json")["prefill"]
    assert [r["system"] for r in prefill][0] == "cpllm" and len(prefill) == 2
    page = tmp_path / "benchmarks.md"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_report.py"), "--results", str(results),
                    "--out", str(page), "--images", str(tmp_path / "img")], check=True, env=env, capture_output=True)
    text = page.read_text()
    assert "## Multi-head latent attention: DeepSeek-V2-Lite's shape (issue 25)" in text
    assert "### Decode at 64 tokens: TP=2 x DCP=2 against TP=2" in text and "| 2x1x2@1 | 64 |" in text

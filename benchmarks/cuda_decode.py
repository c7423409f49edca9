"""The CUDA path measured against its bounds and against transformers, in one run (issue 28's targets).

    python benchmarks/cuda_decode.py [--out FILE] [--layers-8b N] [--hf-compile]   # on a GPU
    python benchmarks/cuda_decode.py --smoke                                         # tiny shapes, CPU

On one GPU, with random bf16 models of Llama-3.2-1B's and Llama-3.1-8B's shapes (written once as Hugging Face
folders; the 8B shape with --layers-8b of its 32 layers, 8 by default so the run fits scripts/gpu_check.sh):
- the machine's bounds through PyTorch: HBM bandwidth (a device-to-device copy) and the bf16 matmul rate;
- 1B, batch 1, contexts 2K and 32K: cpllm decode tokens/s with CUDA graphs and with --enforce-eager, the HBM bound
  (weights + KV bytes read per step over the measured bandwidth) and the fraction of it reached, and transformers'
  `generate` with a static cache (with --hf-compile also under torch.compile) on the same weights;
- 8B shape, batch 64, context 2K: cpllm decode tokens/s (graphs) against transformers (static cache);
- 1B, TTFT at 8K and 32K: cpllm's time to the first token, its useful FLOPs (2 x non-embedding parameters per
  token + causal attention) per second as a fraction of the matmul rate, and transformers' (SDPA) TTFT.
Every figure is printed as one line `FIGURE name value [unit] (target ...)` and collected in --out (JSON).

--smoke runs every measurement on tiny shapes (CPU unless a GPU is visible), a few tokens each: it keeps the
script from rotting (tests/test_cuda_bench_smoke.py runs it), its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self, max_positions: int):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           max_position_embeddings=max_positions, rope_theta=500000.0,
                           tie_word_embeddings=self.tied)

    def linear_params(self) -> int:
        """Parameters of the matmuls each token runs through (the LM head included, the embedding lookup not)."""
        d, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * self.intermediate
        return self.layers * per_layer + self.vocab * d

    def weight_bytes(self, element: int = 2) -> int:
        """Bytes a decode step reads of the weights: every matmul's, the norms', one embedding row (tied: the head
        is the embedding, read once)."""
        norms = (2 * self.layers + 1) * self.hidden
        return (self.linear_params() + norms + self.hidden) * element

    def kv_bytes_per_token(self, element: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    def prefill_flops(self, tokens: int) -> float:
        """Useful FLOPs of one prompt: 2 per linear parameter per token (the LM head on the last row only) plus
        causal attention (QK^T and PV, half the square)."""
        body = self.linear_params() - self.vocab * self.hidden
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * tokens * (tokens + 1) / 2
        return 2.0 * body * tokens + 2.0 * self.vocab * self.hidden + attention


LLAMA_1B = Shape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True)
LLAMA_8B = Shape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False)
SMOKE = Shape("smoke", 64, 2, 4, 2, 128, 512, True)


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    contexts: tuple[int, ...]
    ttft_contexts: tuple[int, ...]
    decode_tokens: int
    batch_big: int
    context_big: int
    big: Shape
    small: Shape
    bytes_probe: int
    matmul_size: int


def full_plan(layers_8b: int) -> Plan:
    big = Shape(LLAMA_8B.name + (f"-{layers_8b}layers" if layers_8b != LLAMA_8B.layers else ""), LLAMA_8B.hidden,
                layers_8b, LLAMA_8B.heads, LLAMA_8B.kv_heads, LLAMA_8B.intermediate, LLAMA_8B.vocab, False)
    return Plan(contexts=(2048, 32768), ttft_contexts=(8192, 32768), decode_tokens=64, batch_big=64,
                context_big=2048, big=big, small=LLAMA_1B, bytes_probe=2 << 30, matmul_size=8192)


SMOKE_PLAN = Plan(contexts=(32, 64), ttft_contexts=(64,), decode_tokens=4, batch_big=3, context_big=16, big=SMOKE,
                  small=SMOKE, bytes_probe=16 << 20, matmul_size=256)


class Figures:
    """The run's figures: printed as they come, kept for --out."""

    def __init__(self):
        self.values: dict[str, dict] = {}

    def add(self, name: str, value: float, unit: str = "", target: str = "") -> None:
        self.values[name] = {"value": value, "unit": unit, "target": target}
        note = f" (target {target})" if target else ""
        print(f"FIGURE {name} {value:.4g} {unit}{note}".rstrip(), flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Best wall time of `fn` over `repeats` runs (after one warm-up), synchronized."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def hbm_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, n: int) -> float:
    """bf16 FLOP/s of an n x n x n matmul (float32 on the CPU, where bf16 is no faster: docs/platform.md)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    seconds = _timed(lambda: a @ b, device)
    return 2.0 * n**3 / seconds


def build_folder(shape: Shape, root: str, max_positions: int, device: torch.device) -> str:
    """A random bf16 model of `shape` as a Hugging Face folder (N(0, 0.02) weights, unit norms), built on the device."""
    from tiny_models import tiny_hf_tokenizer
    from transformers import AutoModelForCausalLM

    folder = os.path.join(root, f"{shape.name}-{shape.layers}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.hf_config(max_positions), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    del model
    _free(device)
    return folder


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


Case = tuple[int, int, int]
"""(batch, context, decode tokens) of one measurement."""


def cpllm_runs(folder: str, shape: Shape, cases: list[Case], *, eager: bool, dtype: str) -> list[dict]:
    """cpllm, one engine for every case: `batch` prompts of `context` tokens, TTFT (max_tokens=1) and decode
    tokens/s (the time of `tokens` more steps), greedy, no prefix cache; plus the greedy tokens (graphs on and off
    must agree)."""
    from cpllm import LLM, SamplingParams

    longest = max(context + tokens for _, context, tokens in cases) + 64
    element = 2 if dtype != "float32" else 4
    kv_bytes = max(shape.kv_bytes_per_token(element) * batch * (context + tokens + 64) for batch, context, tokens
                   in cases)
    results = []
    with LLM(folder, dtype=dtype, max_model_len=longest, max_num_seqs=max(batch for batch, _, _ in cases),
             max_num_batched_tokens=max(max(batch * (context + 1) for batch, context, _ in cases), 8192),
             enable_prefix_caching=False, kv_cache_memory_bytes=int(kv_bytes * 1.2) + (64 << 20),
             enforce_eager=eager) as llm:
        for batch, context, tokens in cases:
            def run(max_tokens: int, seed: int):
                prompts = [{"prompt_token_ids": p} for p in _prompts(batch, context, shape.vocab, seed)]
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

            run(2, seed=99)  # warm-up: kernels compiled for these shapes, allocator grown
            ttft = min(run(1, seed=s)[0] for s in (1, 2))
            total, token_ids = run(tokens + 1, seed=3)
            results.append({"ttft_s": ttft, "decode_tok_s": batch * tokens / max(total - ttft, 1e-9),
                            "tokens": token_ids})
    _free(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return results


def hf_runs(folder: str, shape: Shape, cases: list[Case], device: torch.device, *, compiled: bool) -> list[dict]:
    """transformers as its users run it, one model for every case: `generate` with a static cache (optionally
    the forward under torch.compile), greedy; TTFT (max_new_tokens=1) and decode tokens/s."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    results = []
    for batch, context, tokens in cases:
        ids = torch.tensor(_prompts(batch, context, shape.vocab, seed=3), device=device)

        def run(new: int) -> float:
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, cache_implementation="static", pad_token_id=0)
            _sync(device)
            return time.perf_counter() - start

        run(2)  # warm-up (the static cache, and the compile)
        ttft = min(run(1) for _ in range(2))
        total = run(tokens + 1)
        results.append({"ttft_s": ttft, "decode_tok_s": batch * tokens / max(total - ttft, 1e-9)})
    model = None  # dropped before the next engine takes the memory  # noqa: F841
    _free(device)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens (CPU unless CUDA is there)")
    parser.add_argument("--layers-8b", type=int, default=8, help="layers of the 8B shape (32 = the whole model)")
    parser.add_argument("--hf-compile", action="store_true", help="also time transformers under torch.compile")
    parser.add_argument("--cache", default=None, help="where the random models are written (default: a temp dir)")
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args(argv)

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not args.smoke and device.type != "cuda":
        print("FAIL bench/cuda no CUDA device (use --smoke for the CPU smoke run)")
        return 1
    plan = SMOKE_PLAN if args.smoke else full_plan(args.layers_8b)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    element = 2 if dtype == "bfloat16" else 4
    figures = Figures()
    print(f"# device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
          f", {dtype}", flush=True)

    bandwidth = hbm_bandwidth(device, plan.bytes_probe)
    rate = matmul_rate(device, plan.matmul_size)
    figures.add("bound/hbm_bandwidth", bandwidth / 1e9, "GB/s")
    figures.add("bound/matmul_rate", rate / 1e12, "TFLOP/s")

    with (tempfile.TemporaryDirectory() if args.cache is None else contextlib.nullcontext(args.cache)) as root:
        max_positions = max(plan.contexts + plan.ttft_contexts) + plan.decode_tokens + 128
        small = build_folder(plan.small, root, max_positions, device)
        s, n = plan.small, plan.decode_tokens
        decode_cases = [(1, context, n) for context in plan.contexts]
        ttft_cases = [(1, context, 1) for context in plan.ttft_contexts]
        graphs = cpllm_runs(small, s, decode_cases + ttft_cases, eager=False, dtype=dtype)
        eager = cpllm_runs(small, s, decode_cases, eager=True, dtype=dtype)
        hf = hf_runs(small, s, decode_cases + ttft_cases, device, compiled=False)
        hfc = hf_runs(small, s, decode_cases, device, compiled=True) if args.hf_compile else None
        for i, (_, context, _) in enumerate(decode_cases):
            mine = graphs[i]["decode_tok_s"]
            step_bytes = s.weight_bytes(element) + s.kv_bytes_per_token(element) * (context + n // 2)
            bound = bandwidth / step_bytes
            tag = f"decode_b1_{s.name}_ctx{context}"
            figures.add(f"{tag}/cpllm_graphs", mine, "tok/s")
            figures.add(f"{tag}/cpllm_eager", eager[i]["decode_tok_s"], "tok/s")
            figures.add(f"{tag}/hbm_bound", bound, "tok/s")
            figures.add(f"{tag}/fraction_of_bound", mine / bound, "", ">= 0.6")
            figures.add(f"{tag}/hf_static", hf[i]["decode_tok_s"], "tok/s")
            figures.add(f"{tag}/vs_hf_static", mine / hf[i]["decode_tok_s"], "x", ">= 2")
            figures.add(f"{tag}/graphs_same_tokens", float(graphs[i]["tokens"] == eager[i]["tokens"]), "", "1")
            if hfc is not None:
                figures.add(f"{tag}/hf_static_compiled", hfc[i]["decode_tok_s"], "tok/s")
                figures.add(f"{tag}/vs_hf_static_compiled", mine / hfc[i]["decode_tok_s"], "x")
        for i, (_, context, _) in enumerate(ttft_cases, start=len(decode_cases)):
            tag = f"ttft_{s.name}_ctx{context}"
            useful = s.prefill_flops(context) / graphs[i]["ttft_s"]
            figures.add(f"{tag}/cpllm", graphs[i]["ttft_s"] * 1e3, "ms")
            figures.add(f"{tag}/hf_sdpa", hf[i]["ttft_s"] * 1e3, "ms")
            figures.add(f"{tag}/useful_tflops", useful / 1e12, "TFLOP/s")
            figures.add(f"{tag}/fraction_of_matmul_rate", useful / rate, "", ">= 0.5")
            figures.add(f"{tag}/vs_hf_sdpa", hf[i]["ttft_s"] / graphs[i]["ttft_s"], "x", ">= 1")
        big = build_folder(plan.big, root, plan.context_big + n + 128, device)
        b, case = plan.big, [(plan.batch_big, plan.context_big, n)]
        mine = cpllm_runs(big, b, case, eager=False, dtype=dtype)[0]
        hf = hf_runs(big, b, case, device, compiled=False)[0]
        tag = f"decode_b{plan.batch_big}_{b.name}_ctx{plan.context_big}"
        figures.add(f"{tag}/cpllm_graphs", mine["decode_tok_s"], "tok/s")
        figures.add(f"{tag}/hf_static", hf["decode_tok_s"], "tok/s")
        figures.add(f"{tag}/vs_hf_static", mine["decode_tok_s"] / hf["decode_tok_s"], "x", ">= 1.5")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "dtype": dtype, "figures": figures.values}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

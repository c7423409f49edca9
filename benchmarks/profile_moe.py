"""Where a MoE prefill's time goes: cpllm (driver rank, one rank) and transformers, by category, torch.profiler.

    python benchmarks/profile_moe.py --tokens 1024,4096 --json benchmarks/results/moe_profile.json

The model is moe_bench.py's random Qwen3-MoE-shaped folder. Each module of interest (attention, router, experts,
norms) is wrapped in a profiler region by global forward hooks, so an operator's self time is charged to the
innermost region it ran in and then to a category by its name: a `mm` inside the experts is an expert matmul,
inside attention a q/k/v/o projection, outside any region the LM head. "untracked" is the wall time no operator
accounts for: Python between operators (and, for cpllm, the engine's scheduling around the step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from argparse import Namespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from moe_bench import build_folder  # noqa: E402

from cpllm.bench.common import BenchLayout, machine_info, random_prompt  # noqa: E402
from cpllm.bench.engines import build_llm  # noqa: E402
from cpllm.bench.prefill import time_prefill  # noqa: E402
from cpllm.model.loaders.loader import open_weights  # noqa: E402

MARK = "region::"
REGIONS = {  # module class -> region; both systems' names
    "LlamaAttention": "attention", "Qwen3MoeAttention": "attention",
    "Router": "router", "Qwen3MoeTopKRouter": "router",
    "LocalExperts": "experts", "Qwen3MoeExperts": "experts",
    "RMSNorm": "norm", "Qwen3MoeRMSNorm": "norm",
}
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm", "mkldnn::_linear_pointwise"}
ATTENTION_KERNELS = ("scaled_dot_product", "flash_attention", "aten::_softmax")
INDEXING = ("index", "sort", "gather", "scatter", "nonzero", "bincount", "histc", "cumsum", "one_hot", "topk",
            "where", "unique", "searchsorted", "masked", "repeat_interleave")


def category(region: str | None, op: str) -> str:
    if region == "router":
        return "router (gate matmul, softmax, topk)"
    if region == "experts":
        if op in MATMULS:
            return "expert matmuls"
        if any(word in op for word in INDEXING):
            return "expert sort/index/copy"
        return "norms/elementwise/copies"
    if region == "attention":
        if any(word in op for word in ATTENTION_KERNELS):
            return "attention kernel"
        if op in MATMULS:
            return "q/k/v/o projections"
    if region is None and op in MATMULS:
        return "lm head / other matmuls"
    return "norms/elementwise/copies"


class RegionHooks:
    """Global forward hooks that open a profiler region around each module listed in REGIONS."""

    def __init__(self):
        self.stack: list = []
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(self.enter),
                        torch.nn.modules.module.register_module_forward_hook(self.exit)]

    def enter(self, module, args):
        region = REGIONS.get(type(module).__name__)
        if region:
            self.stack.append(torch.ops.profiler._record_function_enter_new(MARK + region, None))

    def exit(self, module, args, out):
        if REGIONS.get(type(module).__name__):
            torch.ops.profiler._record_function_exit._RecordFunction(self.stack.pop())

    def remove(self):
        for handle in self.handles:
            handle.remove()


def region_of(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(MARK):
            return parent.name[len(MARK):]
        parent = parent.cpu_parent
    return None


def profile_run(run) -> dict[str, float]:
    """Seconds per category of one call of `run()`."""
    from torch.profiler import ProfilerActivity, profile

    hooks = RegionHooks()
    try:
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        wall = time.perf_counter() - start
    finally:
        hooks.remove()
    out: dict[str, float] = {}
    for event in prof.events():
        if event.name.startswith(MARK) or not event.name.startswith(("aten::", "mkldnn::", "cpllm::")):
            continue
        key = category(region_of(event), event.name)
        out[key] = out.get(key, 0.0) + event.self_cpu_time_total / 1e6
    out["untracked (python, engine)"] = max(0.0, wall - sum(out.values()))
    return {"wall": round(wall, 3), **{k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--systems", default="cpllm,transformers")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    folder = build_folder(Namespace(layers=16, hidden=1024, experts=64, top_k=8, expert_size=256,
                                    pcp_tokens=4096, cache="/tmp/cpllm-moe-bench"))
    torch.set_num_threads(args.threads)
    runs = {}
    if "transformers" in args.systems:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        def hf_run(prompt):
            with torch.inference_mode():
                hf(torch.tensor([prompt]), logits_to_keep=1)
        runs[f"transformers ({hf.config._experts_implementation})"] = hf_run
    llm = None
    if "cpllm" in args.systems:
        llm, _ = build_llm(folder, BenchLayout.of(tp=1, pcp=1, dcp=1, threads_per_rank=args.threads), strategy=None,
                           threads_per_rank=args.threads, context_tokens=max(lengths) + 64,
                           batch_tokens=max(lengths) + 64, engine_options=dict(quantization="none"))
        runs["cpllm"] = lambda prompt: time_prefill(llm, prompt)
    vocab = open_weights(folder).config.vocab_size
    result = {"machine": machine_info(), "threads": args.threads, "profiles": {}}
    try:
        for name, run in runs.items():
            run(random_prompt(64, vocab, seed=-1))  # warm-up
        for n in lengths:
            for name, run in runs.items():
                prompt = random_prompt(n, vocab, seed=n)
                table = profile_run(lambda: run(prompt))
                result["profiles"][f"{name} @ {n}"] = table
                print(f"{name} @ {n} tokens: {json.dumps(table)}", flush=True)
    finally:
        if llm is not None:
            llm.shutdown()
    result["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

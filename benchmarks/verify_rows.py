"""The cost of one verify step of R single-token rows of one request against one decode row, on one rank.

    python benchmarks/verify_rows.py --rows 1 2 3 5 9 17 --threads 1 2 --rounds 7 [--json out.json]

A verify chunk of speculative decoding (the request's last token and R - 1 drafts) runs on one rank as R
single-token decode rows at consecutive positions (cpllm/worker/runner.py `_verify_rows`). This builds SmolLM2
(its default GGUF) once per quantization mode, fills a context of `--context` tokens, then times the runner's
`execute` on such a chunk at that context, for each R, thread count and path: "fused" (the fused decode layers,
where they take the step; else the eager ones, as the runner decides) and "eager" (fused layers off). Every
configuration is measured once per round, rounds interleaved, so the shared machine's load reaches them alike;
reported are the median and best seconds per step and their ratio to R = 1 of the same configuration.
`--parts` also times the parts of a step (layers, LM head) for the largest R. Before and after a change, run it
on each tree in turn (PYTHONPATH=<tree>), a few times: the kernels build per source, so both stay cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from cpllm import LLM
from cpllm.bench.common import machine_info
from cpllm.step import ScheduledChunk, SchedulerOutput

BLOCK = 16


def _chunk(tokens: list[int], start: int, drafts: int, blocks: int) -> ScheduledChunk:
    return ScheduledChunk(request_id="r", token_ids=tuple(tokens), start_pos=start, block_table=tuple(range(blocks)),
                          sample=True, prompt_logits=False, num_draft_tokens=drafts)


class Rig:
    """One engine's runner with a filled context of `context` tokens; steps run straight on the runner."""

    def __init__(self, quantization: str, context: int, max_rows: int):
        self.llm = LLM(max_model_len=4096, quantization=quantization, block_size=BLOCK,
                       kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
        self.runner = self.llm.engine.executor._runner
        self.fused = self.runner.model.fused_decode
        self.capabilities = self.runner.capabilities
        """The runner's, with its fused layers; "eager" steps plan with `fused=None` (plan.py `RankCapabilities`)."""
        self.context, self.blocks = context, -(-(context + max_rows) // BLOCK)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, 20000, (context,), generator=g).tolist()
        self.drafts = torch.randint(100, 20000, (max_rows,), generator=g).tolist()
        for start in range(0, context, 512):  # the prompt as prefill chunks (the step budget)
            part = prompt[start:start + 512]
            self.runner.execute(SchedulerOutput(step_id=0, chunks=(_chunk(part, start, 0, self.blocks),)))
        self.step_id = 1

    def step(self, rows: int, fused: bool) -> float:
        """Seconds of one step of `rows` rows at positions context .. context + rows - 1."""
        chunk = _chunk(self.drafts[:rows], self.context, rows - 1, self.blocks)
        self.runner.model.fused_decode = self.fused if fused else None
        self.runner.capabilities = self.capabilities if fused else dataclasses.replace(self.capabilities, fused=None)
        self.step_id += 1
        begin = time.perf_counter()
        logits = self.runner.execute(SchedulerOutput(step_id=self.step_id, chunks=(chunk,)))
        seconds = time.perf_counter() - begin
        self.runner.model.fused_decode, self.runner.capabilities = self.fused, self.capabilities
        assert logits.shape[0] == rows
        return seconds

    def plan(self, rows: int, fused: bool) -> str:
        before = dict(self.runner.plan_counts)
        self.step(rows, fused)
        return next(k for k, v in self.runner.plan_counts.items() if v != before.get(k, 0))

    def parts(self, rows: int, repeats: int) -> dict:
        """Best seconds of the step's layers and of its LM head alone (rows hidden states)."""
        model = self.runner.model
        hidden = torch.randn(rows, self.runner.config.model.hidden_size)
        head = min(_timed(lambda: model.logits(hidden)) for _ in range(repeats))
        whole = min(self.step(rows, True) for _ in range(repeats))
        return {"step": whole, "lm_head": head, "layers_and_rest": whole - head}


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quantization", nargs="+", default=["auto", "none"])
    parser.add_argument("--paths", nargs="+", default=["fused", "eager"], choices=("fused", "eager"))
    parser.add_argument("--context", type=int, default=1300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rigs = {q: Rig(q, args.context, max(args.rows)) for q in args.quantization}
    configs = [(q, p, t, r) for q in args.quantization for p in args.paths for t in args.threads for r in args.rows]
    times = {c: [] for c in configs}
    plans = {}
    for q, p, t, r in configs:  # warm-up, and the plan each step takes
        torch.set_num_threads(t)
        plans[(q, p, t, r)] = rigs[q].plan(r, p == "fused")
    for _ in range(args.rounds):
        for c in configs:
            q, p, t, r = c
            torch.set_num_threads(t)
            times[c].append(rigs[q].step(r, p == "fused"))
    results = {"machine": machine_info(), "context": args.context, "runs": []}
    print(f"{'quant':6} {'path':6} {'thr':>3} {'R':>3} {'plan':>10} {'median ms':>10} {'best ms':>8} "
          f"{'med/R1':>7} {'best/R1':>7}")
    for c in configs:
        q, p, t, r = c
        base = times[(q, p, t, args.rows[0])]
        med, best = statistics.median(times[c]), min(times[c])
        run = dict(quantization=q, path=p, threads=t, rows=r, plan=plans[c], median_s=med, best_s=best,
                   median_ratio=med / statistics.median(base), best_ratio=best / min(base), times=times[c])
        results["runs"].append(run)
        print(f"{q:6} {p:6} {t:>3} {r:>3} {plans[c]:>10} {med * 1e3:>10.2f} {best * 1e3:>8.2f} "
              f"{run['median_ratio']:>7.2f} {run['best_ratio']:>7.2f}", flush=True)
    if args.parts:
        results["parts"] = {}
        for q, rig in rigs.items():
            for t in args.threads:
                torch.set_num_threads(t)
                parts = rig.parts(max(args.rows), args.rounds)
                results["parts"][f"{q}/{t}"] = parts
                print(f"parts {q} threads {t} R={max(args.rows)}: " +
                      ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items()))
    for rig in rigs.values():
        rig.llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

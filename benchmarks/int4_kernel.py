"""The int4 matmul: cpllm's VNNI kernel against aten's int4 CPU kernel, on SmolLM2's linear layers.

    python benchmarks/int4_kernel.py --json benchmarks/results/int4_kernel.json

Both sides are `Int4Linear` layers holding the same random 4-bit groups, one built for each backend
(cpllm/model/formats/group_kernels.py): `vnni` (cpllm/kernels/int4_matmul.c) and `aten` (`_weight_int4pack_mm_for_cpu`,
bfloat16 activations). Per layer: the fused q|k|v (960 x 576), o (576 x 576), gate|up (3,072 x 576) and down
(576 x 1,536) projections; 30 layers with their own weights, so they stream from memory as in a decode step. Rows
of x: 1 (batch-1 decode), 16 (a 16-request decode step) and 512 (a prefill chunk). `error` is each side's output
error against float64 on the dequantized weights (relative Frobenius norm). The sides alternate in rounds; each
cell keeps its median round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpllm.bench.common import machine_info
from cpllm.bench.report import print_table, write_json
from cpllm.kernels import int4_matmul
from cpllm.model.formats.groups import quantize_int4
from cpllm.model.formats.group_kernels import Int4Linear

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
"""(out, in) of each linear of a SmolLM2 layer: q|k|v, o, gate|up, down."""


def _pass_seconds(layers: list[Int4Linear], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def measure(rows: int, threads: int, groups: list, exact: list, rounds: int) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
    sides = {b: [Int4Linear(g, backend=b) for g in groups] for b in ("vnni", "aten")}
    times: dict[str, list[float]] = {b: [] for b in sides}
    for _ in range(rounds):
        for backend, layers in sides.items():
            _pass_seconds(layers, inputs)  # warm-up
            times[backend].append(_pass_seconds(layers, inputs))
    out = []
    for backend, layers in sides.items():
        x = inputs[exact[0].shape[1]]
        error = float((layers[0](x).double() - x.double() @ exact[0].t()).norm() / (x.double() @ exact[0].t()).norm())
        out.append({"backend": backend, "rows": rows, "threads": threads,
                    "ms_30_layers": round(1000 * statistics.median(times[backend]), 3), "error": float(f"{error:.2e}")})
    base = out[1]["ms_30_layers"]
    for row in out:
        row["speedup_vs_aten"] = round(base / row["ms_30_layers"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/int4_kernel.json")
    args = parser.parse_args()
    if not int4_matmul.available():
        raise SystemExit("the VNNI int4 kernel is not built on this machine (no AVX-512 VNNI, or no C compiler)")
    gen = torch.Generator().manual_seed(0)
    groups = [quantize_int4(torch.randn(n, k, generator=gen) * 0.05) for _ in range(LAYERS) for n, k in SHAPES]
    exact = [groups[0].dequantize().double()]
    results = [row for threads in map(int, args.threads.split(",")) for rows in map(int, args.rows.split(","))
               for row in measure(rows, threads, groups, exact, args.rounds if rows < 512 else 3)]
    print_table("int4 matmul, SmolLM2's 30 layers", results)
    write_json(args.json, {"command": "int4_kernel", "machine": machine_info(), "results": results})


if __name__ == "__main__":
    main()

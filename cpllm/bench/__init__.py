"""`cpllm bench`: prefill, decode, serving-load, memory and communication benchmarks.

Each command measures, prints a table, writes JSON and optionally a plot. The
scripts under `benchmarks/` run the same workloads through other systems and
regenerate docs/benchmarks.md from the JSON they write.
"""

"""Execution paths of decode steps besides the eager layers: fused C layers, decode teams, compiled and CUDA-graph steps."""

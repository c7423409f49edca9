"""C kernels compiled for this machine on first use (cpllm/kernels/build.py), each with a torch fallback."""

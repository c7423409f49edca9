"""C kernels compiled for this machine on first use (build.py), each with a torch fallback: library.py opens and
types them and holds the kill switch, checks.py and structs.py check what they are handed."""

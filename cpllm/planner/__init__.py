"""Cost model of context-parallel inference and the `cpllm plan` command built on it.

`cost_model.py` predicts per-rank FLOPs, bytes per collective and how much of the communication hides behind
compute; `strategy.py` uses it to pick a prefill strategy per step (`--cp-prefill-strategy auto`); `plan.py`
ranks every TP x PCP x DCP layout of a cluster with it. No torch is needed except by `calibrate.py`.
"""

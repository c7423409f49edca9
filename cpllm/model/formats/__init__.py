"""Weight formats: how each weight is held and multiplied, and the one registry that picks a format.

- modes.py: the quantization modes (`--quantization`; QUANTIZATION_CHOICES is its table's keys), each a rule for
  which format a tensor runs in given how it is stored. Torch-free (cpllm.config.engine reads it), which is why this
  package's __init__ imports nothing.
- plan.py: the rule applied to one tensor: a WeightPlan (format name and why) per linear, embedding, head and
  stack of routed experts.
- registry.py: FORMATS, every format by name (float, int8, int4). Each entry (entry.py, WeightFormat) builds a tensor
  planned in it: a linear's method, an embedding's rows, a head, a rank's experts. What it builds multiplies
  (`matmul`), describes itself (`describe`) and tells the fused decode layer what it reads in place
  (`fused_spec`, or None). One module per format: float_format.py, int8_format.py, int4_format.py.
- loading.py: plan, then the planned format's loader (one method per run of packed parts sharing a format).
- The methods: base.py (LinearMethod), float_weight.py, onednn.py, grouped.py, concatenated.py; embedding.py
  (EmbeddingRows); lm_head.py (HeadMethod); experts.py (ExpertMethod). methods.py imports them all at once.
- The storage behind them: groups.py (4-bit and 8-bit groups), gguf_blocks.py (GGUF blocks decoded), mxfp4.py
  (GPT-OSS's expert blocks), group_kernels.py (the int4 kernel), group_load.py, refined_head.py (the int8 head's
  float32 refinement), packed_weights.py (oneDNN's layout); report.py, the start-up log of formats and bytes.

The layers (cpllm/model/layers.py) and expert blocks (moe_experts.py, gpt_oss_moe.py) keep the parallel logic
(which rows or columns a rank holds, biases, collectives) and hold one method each, asked, never probed.
"""

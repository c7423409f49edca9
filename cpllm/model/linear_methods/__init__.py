"""Linear methods: each weight format of a linear layer as one object that loads, multiplies and describes it.

The layers (cpllm/model/layers.py) keep the tensor-parallel logic: which rows or columns of which stored tensors a
rank holds, the bias, the collectives. The weight itself is a method, chosen at load by the plan of each stored
tensor (cpllm/model/quant_plan.py) and asked, never probed:

    matmul(x, bias)   x [N, in] -> [N, out]
    describe()        what it runs, for logs
    fused_spec()      the tensor the fused decode layer reads in place (cpllm/model/fused_decode.py), or None
    columns(a, b)     a view of output columns of a plain weight, or None (the PCP decode split of the MLP)
    prepacked()       the same weight in the fastest layout where nothing reads it in place, or itself

Linear formats: FloatWeight (plain [in, out], the only one under quantization=none), OneDNNWeight (float,
prepacked for oneDNN), GroupedWeight (4-bit or 8-bit groups in the int4 kernel) and ConcatenatedWeights (packed
parts held in several formats). The token embedding's rows (FloatRows, StoredInt8Rows) and the LM head's weight
(FloatHead, RefinedInt8Rows) have their own small interfaces: a lookup, and logits with a PCP split. A new format
is one module here and its branch in `loading.py`, which picks each weight's method from its plan.
"""

from cpllm.model.linear_methods.base import FusedWeight, LinearMethod
from cpllm.model.linear_methods.concatenated import ConcatenatedWeights
from cpllm.model.linear_methods.embedding import EmbeddingRows, FloatRows, StoredInt8Rows
from cpllm.model.linear_methods.float_weight import FloatWeight
from cpllm.model.linear_methods.grouped import GroupedWeight
from cpllm.model.linear_methods.lm_head import FloatHead, HeadMethod, RefinedInt8Rows
from cpllm.model.linear_methods.loading import load_embedding, load_head, load_linear
from cpllm.model.linear_methods.onednn import OneDNNWeight

__all__ = ["ConcatenatedWeights", "EmbeddingRows", "FloatHead", "FloatRows", "FloatWeight", "FusedWeight",
           "GroupedWeight", "HeadMethod", "LinearMethod", "OneDNNWeight", "RefinedInt8Rows", "StoredInt8Rows",
           "load_embedding", "load_head", "load_linear"]

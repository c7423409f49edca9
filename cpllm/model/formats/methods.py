"""The weight formats' methods and loaders in one import, for the layers and the tests (the package's map is in
its __init__)."""

from cpllm.model.formats.base import FusedWeight, LinearMethod
from cpllm.model.formats.concatenated import ConcatenatedWeights
from cpllm.model.formats.embedding import EmbeddingRows, FloatRows, StoredInt8Rows
from cpllm.model.formats.experts import ExpertMethod, FloatExperts, GroupedExperts, OneDNNExperts
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.grouped import GroupedWeight
from cpllm.model.formats.lm_head import FloatHead, HeadMethod, RefinedInt8Rows
from cpllm.model.formats.loading import load_embedding, load_experts, load_head, load_linear
from cpllm.model.formats.onednn import OneDNNWeight

__all__ = ["ConcatenatedWeights", "EmbeddingRows", "ExpertMethod", "FloatExperts", "FloatHead", "FloatRows",
           "FloatWeight", "FusedWeight", "GroupedExperts", "GroupedWeight", "HeadMethod", "LinearMethod",
           "OneDNNExperts", "OneDNNWeight", "RefinedInt8Rows", "StoredInt8Rows", "load_embedding", "load_experts",
           "load_head", "load_linear"]

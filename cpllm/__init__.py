"""cpllm: an LLM inference engine for long prompts, built around context parallelism."""

from cpllm.engine.llm import LLM
from cpllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cpllm.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

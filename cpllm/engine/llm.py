"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from cpllm.config import DEFAULT_QUANTIZATION, CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.launch import create_engine
from cpllm.model.default_model import default_model_path
from cpllm.model.loader import open_weights
from cpllm.model.tokenizer import Tokenizer, load_tokenizer

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def build_engine_config(
    model: str | None = None,
    *,
    dtype: str = "float32",
    quantization: str = DEFAULT_QUANTIZATION,
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 64,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    kv_cache_memory_bytes: int | None = None,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    data_parallel_size: int = 1,
    cp_kv_cache_interleave_size: int = 1,
    cp_prefill_strategy: str = "auto",
    cp_kv_cache_layout: str = "sharded",
    distributed_timeout: float = 120.0,
    collective_transport: str = "auto",
    enable_expert_parallel: bool = False,
    compile_decode: bool = False,
) -> EngineConfig:
    """Validate every engine option together, before any process starts."""
    path = model or default_model_path()
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        prefill_context_parallel_size=prefill_context_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        data_parallel_size=data_parallel_size,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        cp_prefill_strategy=cp_prefill_strategy,
        cp_kv_cache_layout=cp_kv_cache_layout,
        distributed_timeout_s=distributed_timeout,
        collective_transport=collective_transport,
        enable_expert_parallel=enable_expert_parallel,
    )
    # quantization lives in ModelConfig (as in vLLM): every rank builds its model from that config alone
    model_config = dataclasses.replace(open_weights(path).config, quantization=quantization)
    max_len = model_config.max_position_embeddings if max_model_len is None else max_model_len
    return EngineConfig(
        model_path=path,
        model=model_config,
        dtype=dtype,
        seed=seed,
        parallel=parallel,
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                          enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=(DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None
                                    else max_num_batched_tokens),
            max_num_seqs=max_num_seqs,
            max_model_len=max_len,
        ),
        compile_decode=compile_decode,
    )


class LLM:
    """Offline batch inference: build once, call `generate` or `chat`, then `shutdown` (or use `with`)."""

    def __init__(self, model: str | None = None, *, threads_per_rank: int | None = None, **engine_options: Any):
        config = build_engine_config(model, **engine_options)
        self.tokenizer: Tokenizer = load_tokenizer(config.model_path)
        self.engine = create_engine(config, self.tokenizer, threads_per_rank=threads_per_rank)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; a prompt is text or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(len(prompts), sampling_params)
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        for (_, token_ids), param in zip(tokenized, params):
            self.engine.check_prompt(token_ids, param)  # refuse the whole batch before any of it runs
        ids = []
        for (text, token_ids), param in zip(tokenized, params):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, param, prompt=text)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(self.tokenizer.apply_chat_template(conv),
                                                       add_special_tokens=False)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(self, count: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(ids), desc="requests", disable=not use_tqdm)
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    results[output.request_id] = output
                    pending.discard(output.request_id)
                    progress.update(1)
        progress.close()
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

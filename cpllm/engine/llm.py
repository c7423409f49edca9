"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from cpllm.config.rope import rope_context_length
from cpllm.config.speculative import speculative_config
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.progress import BarFactory, GenerateProgress, terminal_bars
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine_options import CONFIG_OPTIONS, config_fields, keyword_signature, resolve_options
from cpllm.launch import create_engine
from cpllm.model.loaders.default_model import default_model_path
from cpllm.model.loaders.loader import open_weights
from cpllm.model.tokenization.tokenizer import Tokenizer, load_tokenizer


def build_engine_config(model: str | None = None, **options: Any) -> EngineConfig:
    """Validate every engine option together, before any process starts (options: cpllm.engine_options)."""
    sections = config_fields(resolve_options(options, "build_engine_config", CONFIG_OPTIONS))
    path = model or default_model_path()
    parallel = ParallelConfig(**sections["parallel"])  # refused before the model is read
    # quantization lives in ModelConfig (as in vLLM): every rank builds its model from that config alone
    model_config = dataclasses.replace(open_weights(path).config, **sections["model"])
    scheduler = {"max_model_len": model_config.max_position_embeddings, **sections["scheduler"]}
    draft_config = functools.cache(lambda draft: open_weights(draft).config)  # a draft model is read once
    sections["engine"]["speculative_config"] = speculative_config(
        sections["engine"].get("speculative_config"), model_config.vocab_size,
        lambda draft: draft_config(draft).vocab_size, max_model_len=scheduler["max_model_len"],
        draft_positions=lambda draft: draft_context_length(draft_config(draft)))
    return EngineConfig(model_path=path, model=model_config, parallel=parallel,
                        cache=CacheConfig(**sections["cache"]), scheduler=SchedulerConfig(**scheduler),
                        **sections["engine"])


def draft_context_length(config) -> int:
    """The longest context a draft model's rotary is meant for (its ModelConfig, as the target's is checked)."""
    return rope_context_length(config.rope_scaling, config.max_position_embeddings)


build_engine_config.__signature__ = keyword_signature(build_engine_config, CONFIG_OPTIONS)


class LLM:
    """Offline batch inference: build once, call `generate` or `chat`, then `shutdown` (or use `with`)."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        values = resolve_options(engine_options, "LLM")
        threads_per_rank = values.pop("threads_per_rank")
        max_replica_restarts = values.pop("max_replica_restarts")
        if max_replica_restarts < 0:
            raise ValueError(f"max_replica_restarts must be >= 0, got {max_replica_restarts}")
        config = build_engine_config(model, **values)
        self.tokenizer: Tokenizer = load_tokenizer(config.model_path)
        self.engine = create_engine(config, self.tokenizer, threads_per_rank=threads_per_rank,
                                    max_replica_restarts=max_replica_restarts)
        self._ids = itertools.count()

    __init__.__signature__ = keyword_signature(__init__)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; a prompt is text or {"prompt_token_ids": [...]}.

        use_tqdm=True draws the progress on stderr when it is a terminal (prompt tokens prefilled, tokens
        generated, requests done, each with its rate and time left); a callable (vLLM's form) makes the bars
        itself, called as tqdm is, wherever it draws."""
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
        factory = _bar_factory(use_tqdm)
        sizes = {i: (len(token_ids), None if p.max_tokens is None else p.max_tokens * p.n)
                 for i, (_, token_ids), p in zip(ids, tokenized, params)}
        return self._run(ids, GenerateProgress(factory, sizes) if factory is not None else None)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
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

    def _run(self, ids: list[str], progress: GenerateProgress | None) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        try:
            while pending:
                outputs = self.engine.step()
                for output in outputs:
                    if output.finished and output.request_id in pending:
                        results[output.request_id] = output
                        pending.discard(output.request_id)
                if progress is not None:  # the engine's counts after the step, as plain numbers
                    progress.after_step(self.engine.prompt_progress(),
                                        [(o.request_id, sum(len(c.token_ids) for c in o.outputs), o.finished)
                                         for o in outputs])
        finally:
            if progress is not None:
                progress.close()
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _bar_factory(use_tqdm: bool | Callable[..., Any]) -> BarFactory | None:
    """The bars' maker: the caller's callable as given, else tqdm on stderr where it is a terminal."""
    if callable(use_tqdm):
        return use_tqdm
    if not isinstance(use_tqdm, bool):
        raise TypeError(f"use_tqdm must be a bool or a callable making a tqdm bar, got {type(use_tqdm).__name__}")
    return terminal_bars() if use_tqdm else None

"""A request's state on the driver (torch-free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cpllm.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """One sequence being generated: its tokens, its progress and its KV blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (prefix-cache hits included)."""
    block_tables: list[list[int]] = field(default_factory=list)
    """Virtual block table of each KV group (cpllm/kv_groups.py; set by the scheduler): entry i holds tokens
    [i*V, (i+1)*V) where V = block_size * cp_size, or FREED_BLOCK where a windowed group has freed it."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained SHA-256 digests of the leading full blocks of all_token_ids (a pure function of the tokens)."""
    num_registered_blocks: int = 0
    """Leading blocks of block_ids that are computed and registered in the prefix cache."""
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the request was first scheduled (None before that); a
    preempted request keeps its first count, as vLLM reports it."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Guesses of the tokens after all_token_ids (speculative decoding), set by the engine after each step the
    request advanced in; the scheduler puts them into the request's next decode step as a verify chunk."""
    draft_limit: int | None = None
    """Most drafts the request takes next under speculative decoding's adaptive draft length
    (cpllm/engine/draft_length.py); None: k."""
    kv_pull: object | None = None
    """Disaggregated decode (cpllm/disagg): where its prompt's K/V waits (a `RemotePrefill`), until admission pulls
    it; None: computed here."""
    kv_hold: bool = False
    """Disaggregated prefill: when it finishes its blocks are held for a consumer to pull (cpllm/disagg)."""

    @property
    def block_ids(self) -> list[int]:
        """The block table of KV group 0 (the full-attention layers when the model has any)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

"""Speculative decoding on the driver: drafts in, verified tokens out, and the counters the server exports.

A verify chunk (cpllm/step.py, `num_draft_tokens`) brings back k + 1 rows of logits for a request: row i scores the
token after the last known token and drafts 1..i. The rows are taken in order, each exactly as a decode step
would take it (penalties, masks and the grammar's bitmask on the output so far, the accepted drafts included):
greedy rows keep the argmax, sampled rows run rejection sampling against the draft. A row whose token differs
from its draft (or the row after the last draft) gives the step's last token. So every token the request emits
has the distribution it has without speculation; greedy ones are the same tokens.

Drafts come from prompt lookup (cpllm/engine/ngram_drafter.py, q a point mass) or a draft model
(cpllm/engine/draft_model.py, q its distribution for sampled requests, passed to the rows' rejection sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpllm.config.speculative import SpeculativeConfig
from cpllm.engine.draft_length import next_draft_limit
from cpllm.engine.ngram_drafter import NgramDrafter
from cpllm.engine.request import Request

if TYPE_CHECKING:
    from cpllm.engine.draft_model import DraftModel


@dataclass(frozen=True, slots=True)
class SpecDecodeTotals:
    """Counters since start, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0
    """Verify chunks run (requests x steps that carried drafts)."""
    num_draft_tokens: int = 0
    """Draft tokens scored."""
    num_accepted_tokens: int = 0
    """Of those, the ones kept (the model's own token at that position)."""
    accepted_per_position: tuple[int, ...] = ()
    """Accepted drafts by their index in the chunk (0 = the first draft)."""


class SpeculativeDecoding:
    """Drafts for each request and verifies them; one per engine."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_model: DraftModel | None = None):
        """`draft_model`: the drafter of method "draft_model" (cpllm/engine/draft_model.py), built by the engine
        on its executor."""
        self.config, self.max_model_len = config, max_model_len
        self.drafter = NgramDrafter(config) if config.method == "ngram" else None
        self.draft_model = draft_model
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"speculative_config method={config.method!r} needs a draft model exactly when it is "
                             "'draft_model'")
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_position = [0] * config.num_speculative_tokens

    def describe(self) -> str:
        """One line for the start-up log: what drafts and how."""
        return self.draft_model.describe() if self.draft_model is not None else self.config.describe()

    def room(self, request: Request) -> int:
        """Most drafts the request may take: what it may still emit minus the token every verify step adds (so a
        verify chunk never passes max_tokens or max_model_len), and no more than its adaptive limit."""
        params = request.sampling_params
        limit = params.max_tokens if params.max_tokens is not None else self.max_model_len
        room = min(limit - len(request.output_token_ids), self.max_model_len - request.num_tokens) - 1
        return room if request.draft_limit is None else min(room, request.draft_limit)

    def propose(self, request: Request) -> list[int]:
        """Prompt lookup's drafts after the request's tokens, at most `room(request)`."""
        room = self.room(request)
        return self.drafter.propose(request.all_token_ids, room) if room > 0 else []

    def propose_all(self, requests: list[tuple[Request, torch.Generator | None]]) -> None:
        """Set `draft_token_ids` of every (request, its generator) that just advanced and goes on; a draft model
        drafts them together, in a few batched steps."""
        if self.draft_model is None:
            for request, _ in requests:
                request.draft_token_ids = self.propose(request)
            return
        self.draft_model.propose([(request, generator, self.room(request)) for request, generator in requests])

    def draft_probs(self, request_id: str) -> list[torch.Tensor | None] | None:
        """q of each of the request's current drafts ([vocab] rows; None: a point mass, as for prompt lookup)."""
        return self.draft_model.draft_probs(request_id) if self.draft_model is not None else None

    def release(self, request_id: str) -> None:
        """The request is gone (aborted): its draft model state too."""
        if self.draft_model is not None:
            self.draft_model.release(request_id)

    def verify(self, logits: torch.Tensor, drafts: tuple[int, ...],
               emit: Callable[[torch.Tensor, int | None, torch.Tensor | None], tuple[bool, bool]],
               accept: Callable[[], None], draft_probs: list[torch.Tensor | None] | None = None,
               request: Request | None = None) -> int:
        """Take the rows in order; `emit(row_logits [1, vocab], draft or None, q row or None)` samples one row
        against its draft (drawn from q; None: a point mass), appends the token and returns (accepted, finished);
        `accept()` is called after each accepted draft the request goes on from (its K/V now count, before the
        next row's token is appended). Returns the number of drafts accepted; under the adaptive draft length it
        also sets `request`'s next draft limit.

        logits: [len(drafts) + 1, vocab]; draft_probs: a [vocab] row (or None) per draft, or None."""
        accepted = 0
        for i in range(len(drafts) + 1):
            q = draft_probs[i] if draft_probs is not None and i < len(drafts) else None
            ok, finished = emit(logits[i : i + 1], drafts[i] if i < len(drafts) else None, q)
            if not ok or i == len(drafts):
                break
            accepted += 1
            self._per_position[i] += 1
            if finished:
                break
            accept()
        if request is not None and self.config.draft_length == "adaptive":
            k = self.config.num_speculative_tokens
            request.draft_limit = next_draft_limit(request.draft_limit or k, len(drafts), accepted, k)
        self._drafts += 1
        self._draft_tokens += len(drafts)
        self._accepted += accepted
        return accepted

    @property
    def totals(self) -> SpecDecodeTotals:
        return SpecDecodeTotals(num_drafts=self._drafts, num_draft_tokens=self._draft_tokens,
                                num_accepted_tokens=self._accepted,
                                accepted_per_position=tuple(self._per_position))

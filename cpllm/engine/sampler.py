"""Turns the driver's logits into tokens (and logprobs), one row per running sequence.

Order of operations, as in vLLM v1: the grammar bitmask of structured outputs
first (so logprobs describe the constrained distribution, as vLLM's do), then
logprobs; then min_tokens masking, penalties, logit_bias; greedy rows take the
argmax here; random rows go on through temperature, top-k, top-p, min-p and draw
from their own generator, so a seeded request samples the same tokens whatever
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpllm.engine.outputs import Logprob
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine.rejection_sampler import rejection_sample
from cpllm.structured.bitmask import apply_bitmask_


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample in this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    """This request's own generator; None only when params.greedy."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids, masked (with stop_token_ids) until min_tokens is reached."""


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None
    """The sampled token plus the top `params.logprobs` tokens; None when not requested."""


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded for one request; any Python int is accepted as seed."""
    gen = torch.Generator(device=device)
    # manual_seed refuses values outside 64 bits; wrap so negative / huge seeds work.
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


class Sampler:
    """Stateless: all per-request state arrives in the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        # logits: [num_rows, vocab] raw model logits; bitmask: [num_rows, ceil(vocab/32)] int32 of allowed
        # tokens (structured outputs), or None when no row is constrained
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows"
            )
        logits = logits.float()
        if bitmask is not None:
            logits = logits.clone()  # the caller's tensor stays as the model produced it
            apply_bitmask_(logits, bitmask)
        processed = _process_logits(logits, rows)
        token_ids = _choose_tokens(processed, rows)
        logprobs = _sampled_logprobs(logits, rows, token_ids)
        return [SampledToken(token_id=t, logprobs=lp) for t, lp in zip(token_ids, logprobs)]

    def against_draft(self, logits: torch.Tensor, row: SamplingRow, bitmask: torch.Tensor | None,
                      draft: int | None, draft_probs: torch.Tensor | None = None) -> tuple[SampledToken, bool]:
        """One row of a verify chunk (cpllm/engine/spec_decode.py): the token this row yields, and whether it is
        the draft. The same processing as `__call__`; a greedy row takes the argmax, a sampled one keeps the
        draft by rejection sampling against q, the distribution the draft was drawn from (`draft_probs`; None: a
        point mass on the draft), so its token has the distribution `__call__` would draw from. No draft (the row
        after the last one): an ordinary draw.

        logits: [1, vocab]; bitmask: [1, ceil(vocab/32)] or None; draft_probs: [vocab] or None."""
        if draft is None or row.params.greedy:
            token = self(logits, [row], bitmask)[0]
            return token, token.token_id == draft
        logits = logits.float()
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask_(logits, bitmask)
        processed = _process_logits(logits, [row])[0].to(row.generator.device)  # [vocab]
        probs = restricted_probs(processed, row.params)
        if not torch.isfinite(probs).all() or not probs.sum() > 0:
            token_id = int(processed.argmax().item())  # as _sample_row: every token masked
        else:
            q = None if draft_probs is None else draft_probs.to(device=probs.device, dtype=probs.dtype)
            token_id, _ = rejection_sample(probs, draft, row.generator, q)
        logprobs = _sampled_logprobs(logits, [row], [token_id])[0]
        return SampledToken(token_id=token_id, logprobs=logprobs), token_id == draft


def _sampled_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
) -> list[dict[int, Logprob] | None]:
    """Entries from the raw logits (before penalties), for the rows that asked."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[dict[int, Logprob] | None] = [None] * len(rows)
    if wanted:
        lps = torch.log_softmax(logits[wanted], dim=-1)  # [len(wanted), vocab]
        # a row that names its tokens (logprob_token_ids) gets those instead of its top alternatives
        tops = [0 if rows[i].params.logprob_token_ids else rows[i].params.logprobs for i in wanted]
        entries = logprob_entries(lps, [token_ids[i] for i in wanted], tops)
        for j, (i, entry) in enumerate(zip(wanted, entries)):
            if rows[i].params.logprob_token_ids:
                entry.update(_named_entries(lps[j], rows[i].params.logprob_token_ids))
            out[i] = entry
    return out


def _named_entries(logprobs: torch.Tensor, token_ids: Sequence[int]) -> dict[int, Logprob]:
    """The logprob and rank of each named token; logprobs: [vocab] one log_softmax row. Ids outside the
    vocabulary are left out (the server refuses them before they get here)."""
    ids = [t for t in token_ids if t < logprobs.shape[0]]
    values = logprobs[torch.tensor(ids, dtype=torch.long, device=logprobs.device)]  # [len(ids)]
    ranks = ((logprobs[None, :] > values[:, None]).sum(dim=-1) + 1).tolist()
    return {t: Logprob(logprob=v, rank=r) for t, v, r in zip(ids, values.tolist(), ranks)}


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return (p.has_penalties or bool(p.logit_bias) or bool(_masked_stop_ids(row)) or p.allowed_token_ids is not None
            or bool(p.bad_words_token_ids))


def _process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens masking, penalties and logit_bias, applied to a copy only when some row needs them."""
    todo = [i for i, r in enumerate(rows) if _needs_processing(r)]
    if not todo:
        return logits
    out = logits.clone()
    for i in todo:
        _mask_stop_ids(out[i], rows[i])
        apply_penalties(out[i], rows[i].params, rows[i].prompt_token_ids, rows[i].output_token_ids)
        apply_logit_bias(out[i], rows[i].params.logit_bias)
        apply_token_masks(out[i], rows[i])
        if not torch.isfinite(out[i]).any():
            # min_tokens masked the only tokens a grammar allows (or a bias of -100 meets a mask):
            # the grammar wins, so there is always a token to draw.
            out[i] = logits[i]
    return out


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float] | None) -> None:
    """logits[token] += bias for each entry, in place (ids outside the logits are refused earlier)."""
    # logits: [vocab]
    if not logit_bias:
        return
    ids = torch.tensor(list(logit_bias), dtype=torch.long, device=logits.device)
    biases = torch.tensor(list(logit_bias.values()), dtype=logits.dtype, device=logits.device)
    logits.index_add_(0, ids, biases)


def apply_token_masks(logits: torch.Tensor, row: SamplingRow) -> None:
    """allowed_token_ids and bad words, in place: masked ids get -inf."""
    # logits: [vocab]
    allowed = row.params.allowed_token_ids
    if allowed is not None:
        keep = torch.full_like(logits, float("-inf"))
        ids = torch.tensor([t for t in allowed if t < logits.shape[0]], dtype=torch.long, device=logits.device)
        keep[ids] = 0.0
        logits.add_(keep)
    banned = []
    output = list(row.output_token_ids)
    for word in row.params.bad_words_token_ids or ():
        prefix = word[:-1]
        if word[-1] < logits.shape[0] and (not prefix or output[-len(prefix):] == prefix):
            banned.append(word[-1])
    if banned:
        logits[banned] = float("-inf")


def _masked_stop_ids(row: SamplingRow) -> list[int]:
    """Ids that may not be sampled yet because fewer than min_tokens were generated."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    ids = list(p.stop_token_ids or [])
    if not p.ignore_eos:
        ids.extend(row.eos_token_ids)
    return ids


def _mask_stop_ids(logits: torch.Tensor, row: SamplingRow) -> None:
    # logits: [vocab], modified in place
    ids = [t for t in _masked_stop_ids(row) if t < logits.shape[0]]
    if ids:
        logits[ids] = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> None:
    """Repetition penalty over prompt+output, frequency/presence over output, in place.

    logits: [vocab]. Repetition divides positive logits and multiplies negative
    ones by the penalty; then logit -= frequency * count + presence * (count > 0).
    """
    if not params.has_penalties:
        return
    vocab = logits.shape[0]
    device = logits.device
    out_ids = torch.tensor(list(output_token_ids), dtype=torch.long, device=device)
    counts = torch.bincount(out_ids, minlength=vocab)[:vocab]  # [vocab]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)
        seen[prompt[prompt < vocab]] = True
        penalty = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    if params.frequency_penalty != 0.0:
        logits -= params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty != 0.0:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Argmax for greedy rows (one batched op), a draw from the row's generator otherwise."""
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for i, tok in zip(greedy, picked):
            tokens[i] = tok
    for i, row in enumerate(rows):
        if not row.params.greedy:
            tokens[i] = _sample_row(logits[i], row)
    return tokens


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    # logits: [vocab], penalised
    gen = row.generator
    if gen is None:
        raise ValueError(
            f"row with temperature={row.params.temperature} needs a generator "
            "(only greedy rows may pass generator=None)"
        )
    # Draw on the generator's device so the stream depends on the seed alone.
    logits = logits.to(gen.device)
    probs = restricted_probs(logits, row.params)
    if not torch.isfinite(probs).all() or not probs.sum() > 0:
        # Nothing left to draw from (every token masked): take the best logit rather than fail the whole step.
        return int(logits.argmax().item())
    return int(torch.multinomial(probs, 1, generator=gen).item())


def restricted_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (zero outside the support).

    logits: [vocab] -> [vocab]
    """
    # A tiny temperature or repetition penalty can push a logit past the float range; +inf would make the
    # softmax NaN, so it is clamped to the largest finite value (the token stays the most likely one).
    logits = torch.nan_to_num(logits / params.temperature, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    top_k = params.top_k_or_none
    if top_k is not None and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        # Ties with the k-th value are kept, as in vLLM.
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        # The ratio to the top probability is unchanged by the renormalising after
        # top-k / top-p, so the threshold can use these probabilities as they are.
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # logits: [vocab]. Keep a token when the mass of the tokens strictly more
    # likely than it is below top_p; the most likely token always stays.
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logprob_entries(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_tops: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row: the given token, then its num_top most likely tokens, each with a rank.

    logprobs: [m, vocab] log_softmax rows; token_ids, num_tops: [m]. The given
    token's rank is 1 + the number of strictly more likely tokens; the top
    tokens are ranked 1..num_top by position, as in vLLM.
    """
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])  # [m, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = min(max(num_tops, default=0), logprobs.shape[1])
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)  # [m, k]
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    entries = []
    for i, (tok, lp) in enumerate(zip(token_ids, chosen[:, 0].tolist())):
        entry = {int(tok): Logprob(logprob=lp, rank=ranks[i])}
        for r in range(min(num_tops[i], k)):
            entry.setdefault(top_ids[i][r], Logprob(logprob=top_values[i][r], rank=r + 1))
        entries.append(entry)
    return entries


def prompt_logprobs(
    logits: torch.Tensor, target_ids: Sequence[int], num_top: int
) -> list[dict[int, Logprob]]:
    """Logprobs of the prompt's next tokens from the logits at positions 0..n-1.

    logits: [n, vocab], row i predicts target_ids[i] (the prompt token at i+1).
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match {len(target_ids)} target ids"
        )
    if len(target_ids) == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    return logprob_entries(logprobs, target_ids, [num_top] * len(target_ids))

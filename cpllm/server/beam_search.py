"""Beam search (vLLM's `use_beam_search`, `n` beams, `length_penalty`), run by the server over ordinary engine
requests, as vLLM's own front end runs it.

Each step asks the engine, for every live beam, for the 2 x width most likely next tokens: a one-token request
whose prompt is the beam (the prefix cache serves what earlier steps computed) and whose logprobs are those
alternatives. Of all the extensions the width of highest cumulative logprob are kept; those that end in a stop
token (EOS unless ignore_eos, or one of stop_token_ids) are set aside as finished, the others go on. After
max_tokens steps, or once no beam is live, every beam is ranked by cumulative logprob / length ** length_penalty
(length: prompt plus output, a final stop token not counted) and the best `n` are the choices. The logprobs are the
model's raw ones (as vLLM's V1 engine ranks beams), so temperature does not change the search.
"""

from __future__ import annotations

import dataclasses

from cpllm.engine.outputs import CompletionOutput, RequestOutput, RequestMetrics
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.errors import bad_request
from cpllm.server.formatting import top_entries
from cpllm.server.protocol import SamplingFields
from cpllm.server.requests import Prompt, ServerContext

SEARCH_FIELDS = frozenset({"use_beam_search", "length_penalty", "n", "best_of", "max_tokens", "max_completion_tokens",
                           "ignore_eos", "stop_token_ids", "temperature", "seed", "skip_special_tokens", "echo",
                           "return_token_ids", "add_special_tokens", "truncate_prompt_tokens", "truncation_side",
                           "request_id", "model", "prompt", "messages", "add_generation_prompt",
                           "continue_final_message", "chat_template", "chat_template_kwargs", "prompt_token_ids",
                           "user", "stream_options", "include_reasoning", "spaces_between_special_tokens"})
"""Fields a beam-search request may set; any other set to a non-default value is refused (it would be ignored)."""


@dataclasses.dataclass(slots=True)
class Beam:
    """One hypothesis: its output tokens and their summed logprob."""

    tokens: list[int]
    logprob: float
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BeamSettings:
    """A request's search."""

    width: int
    """Beams kept per step, and choices returned (the request's n)."""
    max_tokens: int
    """Steps at most."""
    length_penalty: float
    """Exponent of the length the score divides by (> 1 favours longer outputs, < 1 shorter ones)."""
    eos_ids: frozenset[int]
    """Tokens that finish a beam (empty with ignore_eos)."""
    stop_ids: frozenset[int]
    """stop_token_ids: also finish a beam, reported as its stop_reason."""
    skip_special_tokens: bool


def check_beam_request(req: SamplingFields) -> None:
    """400 for what a beam search cannot do; n=1 points to greedy decoding, which it would be."""
    if req.stream:
        raise bad_request("use_beam_search does not stream: the beams are ranked once every one has ended",
                          "use_beam_search")
    if req.n < 2:
        raise bad_request("use_beam_search needs n >= 2 beams; with one beam it is greedy decoding (temperature=0)",
                          "use_beam_search")
    for name in sorted(req.model_fields_set - SEARCH_FIELDS):
        field = type(req).model_fields.get(name)
        if field is not None and getattr(req, name) != field.default:
            raise bad_request(f"{name} cannot be combined with use_beam_search (the search ranks beams by the "
                              "model's logprobs alone)", name)


async def beam_search(ctx: ServerContext, request_id: str, prompt: Prompt, settings: BeamSettings,
                      arrival_time: float) -> RequestOutput:
    """The search's best `width` beams, as the engine's RequestOutput of one request with `width` choices."""
    live, done = [Beam(tokens=[], logprob=0.0)], []
    limit = ctx.engine.max_model_len
    if settings.max_tokens != limit and len(prompt.token_ids) + settings.max_tokens > limit:
        raise bad_request(f"the prompt ({len(prompt.token_ids)} tokens) plus max_tokens={settings.max_tokens} "
                          f"exceeds max_model_len={limit}", "max_tokens")
    alternatives = 2 * settings.width
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=alternatives,
                            max_logprobs=max(alternatives, 20))
    for step in range(settings.max_tokens):
        room = [b for b in live if len(prompt.token_ids) + len(b.tokens) < limit]
        done += [dataclasses.replace(b, finish_reason="length") for b in live if b not in room]
        if not room:
            live = []
            break
        prompts = [Prompt(token_ids=prompt.token_ids + b.tokens, text=None) for b in room]
        streams = await requests.start(ctx, f"{request_id}-step{step}", prompts, params, arrival_time)
        try:
            outputs = await requests.results(streams)
        finally:
            requests.close(request_id, streams, log=False)
        candidates = [Beam(tokens=[*beam.tokens, tok], logprob=beam.logprob + lp)
                      for beam, out in zip(room, outputs)
                      for tok, lp in top_entries(out.outputs[0].logprobs[0], alternatives)]
        candidates.sort(key=lambda b: b.logprob, reverse=True)
        live = []
        for beam in candidates[: settings.width]:
            last = beam.tokens[-1]
            if last in settings.eos_ids or last in settings.stop_ids:
                beam.finish_reason = "stop"
                beam.stop_reason = last if last in settings.stop_ids else None
                done.append(beam)
            else:
                live.append(beam)
        if not live:
            break
    done += [dataclasses.replace(b, finish_reason="length") for b in live]
    best = sorted(done, key=lambda b: _score(b, len(prompt.token_ids), settings), reverse=True)[: settings.width]
    return _output(ctx, request_id, prompt, best, settings, arrival_time)


def _score(beam: Beam, prompt_len: int, settings: BeamSettings) -> float:
    length = prompt_len + len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
    return beam.logprob / max(length, 1) ** settings.length_penalty


def _output(ctx: ServerContext, request_id: str, prompt: Prompt, beams: list[Beam], settings: BeamSettings,
            arrival_time: float) -> RequestOutput:
    """The beams as one request's choices (text without the stop token that ended a beam, as sampling gives it)."""
    tokenizer = ctx.engine.tokenizer
    choices = []
    for index, beam in enumerate(beams):
        shown = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens
        choices.append(CompletionOutput(index=index, text=tokenizer.decode(shown, settings.skip_special_tokens),
                                        token_ids=list(beam.tokens), finish_reason=beam.finish_reason,
                                        stop_reason=beam.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt.text, prompt_token_ids=list(prompt.token_ids),
                         outputs=choices, finished=True, metrics=RequestMetrics(arrival_time=arrival_time))


def beam_settings(ctx: ServerContext, req: SamplingFields, params: SamplingParams) -> BeamSettings:
    """The search a request asks for (its SamplingParams already validated n, max_tokens and the token ids)."""
    eos = getattr(ctx.engine.engine, "eos_token_ids", ()) or ctx.engine.tokenizer.eos_token_ids
    return BeamSettings(width=params.n, max_tokens=params.max_tokens or ctx.engine.max_model_len,
                        length_penalty=req.length_penalty, eos_ids=frozenset() if params.ignore_eos else frozenset(eos),
                        stop_ids=frozenset(params.stop_token_ids), skip_special_tokens=params.skip_special_tokens)

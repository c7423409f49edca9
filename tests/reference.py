"""Reference results from Hugging Face transformers, and comparisons of engine outputs against them."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation by full re-forwards: (tokens, logprob of each token, prompt logprobs of positions 1..)."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    prompt_lp = None
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        if prompt_lp is None:
            prompt_lp = [lp[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
        token = int(lp[-1].argmax())
        tokens.append(token)
        logprobs.append(lp[-1, token].item())
        ids.append(token)
    return tokens, logprobs, prompt_lp


def as_float(value) -> float:
    return value.logprob if hasattr(value, "logprob") else float(value)


def check_against_hf(output, ref_tokens, ref_logprobs, ref_prompt_lp=None, atol=1e-4) -> None:
    """Same greedy tokens, and logprobs within `atol` of the reference."""
    completion = output.outputs[0]
    n = min(len(completion.token_ids), len(ref_tokens))
    assert completion.token_ids[:n] == ref_tokens[:n], (completion.token_ids, ref_tokens)
    if completion.logprobs is not None:
        got = [as_float(step[tok]) for step, tok in zip(completion.logprobs, completion.token_ids)]
        diff = max(abs(a - b) for a, b in zip(got[:n], ref_logprobs[:n]))
        assert diff <= atol, f"sampled-token logprobs differ by {diff}"
    if ref_prompt_lp is not None:
        assert output.prompt_logprobs[0] is None
        ids = output.prompt_token_ids
        got = [as_float(output.prompt_logprobs[i][ids[i]]) for i in range(1, len(ids))]
        diff = max((abs(a - b) for a, b in zip(got, ref_prompt_lp)), default=0.0)
        assert diff <= atol, f"prompt logprobs differ by {diff}"

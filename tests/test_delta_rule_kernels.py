"""The delta rules' C kernels against their torch forms (cpllm/layers/*_delta/rule.py `*_torch`, the fallbacks):
the recurrent decode step of both rules (cpllm/kernels/delta_step.c) and both rules' chunked prefill
(cpllm/kernels/delta_chunk.c, kda_chunk.c), on random inputs of sizes that are not multiples of 16, a state
carried in and out, batch > 1 for the step, prompt lengths not a multiple of the block; and CPLLM_KERNELS=0 runs
the torch forms."""

from __future__ import annotations

import pytest
import torch

from cpllm.kernels.delta_chunk import delta_chunk
from cpllm.kernels.delta_step import delta_step
from cpllm.kernels.library import load
from cpllm.layers.gated_delta import rule as gated
from cpllm.layers.kimi_delta import rule as kimi



needs_kernels = pytest.mark.skipif(
    any(load(name) is None for name in ("delta_step", "delta_chunk", "kda_chunk")),
    reason="the delta kernels are off (CPLLM_KERNELS=0) or not built here")
"""For the tests that check the kernels ran; the rest compare whichever path runs."""


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    assert ((got - want).abs().max() / scale).item() < rel


def _inputs(lead: tuple[int, ...], h: int, dk: int, dv: int, per_channel: bool, gen: torch.Generator):
    q = gated.l2norm(torch.randn(*lead, h, dk, generator=gen)) * dk**-0.5
    k = gated.l2norm(torch.randn(*lead, h, dk, generator=gen))
    v = torch.randn(*lead, h, dv, generator=gen)
    g = -torch.rand(*lead, h, *((dk,) if per_channel else ()), generator=gen) * 0.5
    beta = torch.rand(*lead, h, generator=gen)
    return q, k, v, g, beta


@needs_kernels
@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
@pytest.mark.parametrize("b, h, dk, dv", [(1, 4, 128, 128), (3, 5, 40, 24), (2, 7, 17, 33)])
def test_step_kernel_matches_torch(rule, b, h, dk, dv):
    gen = torch.Generator().manual_seed(b * 100 + dk)
    q, k, v, g, beta = _inputs((b,), h, dk, dv, rule is kimi, gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.1
    kept = state.clone()
    assert delta_step(q, k, v, g, beta, state) is not None  # the kernel runs here
    out, new = rule.recurrent_step(q, k, v, g, beta, state)
    want_out, want_new = rule.recurrent_step_torch(q, k, v, g, beta, state)
    _close(out, want_out)
    _close(new, want_new)
    assert torch.equal(state, kept)  # the state passed in is not written
    # a second token from the state the first left
    out2, new2 = rule.recurrent_step(q.flip(0), k, v, g, beta, new)
    want2, want_new2 = rule.recurrent_step_torch(q.flip(0), k, v, g, beta, want_new)
    _close(out2, want2)
    _close(new2, want_new2)


CHUNKED = {gated: (gated.chunked_delta_rule, gated.chunked_delta_rule_torch),
           kimi: (kimi.chunked_kda, kimi.chunked_kda_torch)}


@needs_kernels
@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
@pytest.mark.parametrize("t, h, dk, dv", [(1, 3, 16, 16), (64, 2, 128, 128), (100, 5, 40, 24), (257, 3, 17, 33)])
def test_chunk_kernel_matches_torch(rule, t, h, dk, dv):
    gen = torch.Generator().manual_seed(t)
    q, k, v, g, beta = _inputs((t,), h, dk, dv, rule is kimi, gen)
    chunked, chunked_torch = CHUNKED[rule]
    state = torch.randn(h, dk, dv, generator=gen) * 0.1
    kept = state.clone()
    assert delta_chunk(q, k, v, g, beta, state) is not None
    out, new = chunked(q, k, v, g, beta, state)
    want_out, want_new = chunked_torch(q, k, v, g, beta, state)
    assert out.shape == (t, h, dv) and new.shape == (h, dk, dv)
    _close(out, want_out)
    _close(new, want_new)
    assert torch.equal(state, kept)
    # the state carried out, carried into the next chunk, gives the whole prompt's outputs
    first, rest = t // 2 or 1, slice(t // 2 or 1, None)
    a, mid = chunked(q[:first], k[:first], v[:first], g[:first], beta[:first], state)
    if t > first:
        b, end = chunked(q[rest], k[rest], v[rest], g[rest], beta[rest], mid)
        a = torch.cat([a, b])
    else:
        end = mid
    _close(a, want_out)
    _close(end, want_new)


@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
def test_chunk_kernel_matches_steps(rule):
    """The chunked kernel over 70 tokens against the step kernel token by token."""
    gen = torch.Generator().manual_seed(7)
    t, h, dk, dv = 70, 3, 24, 40
    q, k, v, g, beta = _inputs((t,), h, dk, dv, rule is kimi, gen)
    state = torch.randn(h, dk, dv, generator=gen) * 0.1
    out, end = CHUNKED[rule][0](q, k, v, g, beta, state)
    step_state = state[None]
    for i in range(t):
        o, step_state = rule.recurrent_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                             beta[i : i + 1], step_state)
        _close(o[0], out[i], 1e-4)
    _close(step_state[0], end, 1e-4)


def test_kill_switch_runs_the_torch_forms(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs((2,), 3, 20, 12, False, gen)
    state = torch.randn(2, 3, 20, 12, generator=gen)
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert delta_step(q, k, v, g, beta, state) is None
    assert delta_chunk(q[0][None], k[0][None], v[0][None], g[0][None], beta[0][None], state[0]) is None
    out, new = gated.recurrent_step(q, k, v, g, beta, state)
    want_out, want_new = gated.recurrent_step_torch(q, k, v, g, beta, state)
    assert torch.equal(out, want_out) and torch.equal(new, want_new)
    out, new = gated.chunked_delta_rule(q, k, v, g, beta, state[0])
    want_out, want_new = gated.chunked_delta_rule_torch(q, k, v, g, beta, state[0])
    assert torch.equal(out, want_out) and torch.equal(new, want_new)
    gk = -torch.rand(2, 3, 20, generator=gen)
    assert delta_chunk(q, k, v, gk, beta, state[0]) is None
    out, new = kimi.chunked_kda(q, k, v, gk, beta, state[0])
    want_out, want_new = kimi.chunked_kda_torch(q, k, v, gk, beta, state[0])
    assert torch.equal(out, want_out) and torch.equal(new, want_new)


@needs_kernels
def test_kernels_decline_what_they_do_not_read():
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = _inputs((2,), 3, 20, 12, False, gen)
    state = torch.randn(2, 3, 20, 12, generator=gen)
    assert delta_step(q.double(), k, v, g, beta, state) is None
    with pytest.raises(ValueError):
        delta_step(q, k, v[..., :5], g, beta, state)
    with pytest.raises(ValueError):
        delta_chunk(q, k, v, g, beta, state[0, :2])
    with pytest.raises(ValueError):
        delta_chunk(q, k, v, -torch.rand(2, 3, 7), beta, state[0])


@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
def test_chunk_kernel_threads_split_the_heads(rule):
    """Two threads (each its heads' states across every block) give the one-thread bits."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _inputs((130,), 5, 24, 20, rule is kimi, gen)
    state = torch.randn(5, 24, 20, generator=gen) * 0.1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CHUNKED[rule][0](q, k, v, g, beta, state)
        torch.set_num_threads(2)
        two = CHUNKED[rule][0](q, k, v, g, beta, state)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
def test_chunk_kernel_strong_decays(rule):
    """Decays of up to e^-15 a token (products down to underflow inside a block) still match the torch form."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = _inputs((150,), 3, 20, 36, rule is kimi, gen)
    g = g * 30
    state = torch.randn(3, 20, 36, generator=gen) * 0.1
    chunked, chunked_torch = CHUNKED[rule]
    for got, want in zip(chunked(q, k, v, g, beta, state), chunked_torch(q, k, v, g, beta, state)):
        assert torch.isfinite(got).all()
        _close(got, want)


@needs_kernels
@pytest.mark.parametrize("rule", [gated, kimi], ids=["gated_delta", "kimi_delta"])
def test_step_kernel_overwrites_the_state_it_is_given(rule):
    """overwrite=True (the layer's gathered copy) writes the new states over `state`: the same values."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = _inputs((2,), 3, 40, 24, rule is kimi, gen)
    state = torch.randn(2, 3, 40, 24, generator=gen) * 0.1
    want_out, want_new = rule.recurrent_step_torch(q, k, v, g, beta, state)
    out, new = rule.recurrent_step(q, k, v, g, beta, state, overwrite=True)
    assert new.data_ptr() == state.data_ptr()
    _close(out, want_out)
    _close(new, want_new)

"""Prompt chunks split over PCP ranks through a gated DeltaNet layer, exact (docs/context_parallel.md, "State
scan").

The head-tail split gives each PCP rank up to two runs of a prompt chunk's tokens. Two things cross the runs:
- the causal convolution reads the conv_kernel - 1 inputs before each run: every rank all-gathers each run's last
  conv_kernel - 1 inputs (the halo), tiny;
- the delta rule is affine in its state (per value head, S_end = M S_in + B): each rank runs each of its runs once
  from the state [0 | I] with values [v | 0] (d_k extra value columns, so the triangular solves and the decays are
  shared), which gives at once the zero-state outputs and B (the first d_v columns) and the run's transition M and
  each output's dependence on S_in (the last d_k: out_t = o_t + S_in^T r_t). The ranks all-gather every run's
  [B | M], compose them in sequence order from the request's state (context_parallel/state_scan.py), correct their
  outputs and all store the same final state and conv window in the request's slot: under PCP every rank runs the
  decode rows of every request alike (the plan never splits single tokens of a model with states).

Two all-gathers per layer and step, whatever the number of requests; the collectives depend only on the step's
metadata, so every PCP rank issues the same ones.

Any delta rule whose state update is a left multiplication plus a rank-one write (S <- P_t S + k_t u_t^T) runs
here: Kimi delta attention's per-channel decay too (cpllm/layers/kimi_delta/). The layer supplies `pcp`, `linear`
(its `conv_kernel`), `conv_channels`, `conv_weight`, `hv`, `dk`, `dv`, `_heads` (convolved channels -> q, k, v) and
`chunk_rule` (the chunked rule: q, k, v, g, beta, state -> out, state; g indexed by token first).
"""

from __future__ import annotations

import torch

from cpllm.context_parallel.state_scan import Run, exclusive_scan, gather_pieces, preceding_rows, sequence_runs


def pcp_prefill(layer, requests, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state, core) -> None:
    """The prompt chunks `requests` (num_new > 1, split over `layer.pcp`) of one step: writes this rank's rows of
    `core` [N, Hv, dv] and every request's final state into its slot (the same on every PCP rank). `mixed`
    [N, conv channels] the projected conv inputs of this rank's rows, g and beta [N, Hv]."""
    pcp, keep, channels = layer.pcp, layer.linear.conv_kernel - 1, layer.conv_channels
    conv_pool, delta_pool = state
    plans = [(request, sequence_runs(request.source_rank_rows)) for request in requests]
    counts = [sum(run.rank == p for _, runs in plans for run in runs) for p in range(pcp.size)]
    mine = [run for _, runs in plans for run in runs if run.rank == pcp.rank]
    like = mixed.new_empty(keep, channels, dtype=torch.float32)
    tails = _by_run(plans, gather_pieces(pcp, [_tail(mixed, run, keep) for run in mine], counts, like))
    windows = {}
    for request, runs in plans:
        window = conv_pool[request.state_slot].transpose(0, 1)  # [K - 1, C], the last input last
        windows[id(request)] = window if request.start_pos else torch.zeros_like(window)
    local = {}  # run -> (zero-state outputs [T, Hv, dv], dependence on S_in [T, Hv, dk], [B | M])
    for request, runs in plans:
        for run in runs:
            if run.rank == pcp.rank:
                halo = preceding_rows(run.start, keep, runs, tails, windows[id(request)])
                local[run] = _run_from_zero(layer, halo, mixed[run.row : run.row + run.length], g, beta, run)
    maps = _by_run(plans, gather_pieces(pcp, [local[run][2] for run in mine], counts,
                                        like.new_empty(layer.hv, layer.dk, layer.dv + layer.dk)))
    for request, runs in plans:
        slot, dv = request.state_slot, layer.dv
        initial = delta_pool[slot].view(layer.hv, layer.dk, dv)
        if not request.start_pos:
            initial = torch.zeros_like(initial)
        starts, final = exclusive_scan([(maps[run][..., dv:], maps[run][..., :dv]) for run in runs], initial)
        for run, start in zip(runs, starts):
            if run.rank == pcp.rank:
                zero_out, dependence, _ = local[run]
                core[run.row : run.row + run.length] = zero_out + torch.einsum("thk,hkv->thv", dependence, start)
        window = preceding_rows(request.num_new, keep, runs, tails, windows[id(request)])
        conv_pool[slot] = window.transpose(0, 1)
        delta_pool[slot] = final.reshape(layer.hv, -1)


def _tail(mixed: torch.Tensor, run: Run, keep: int) -> torch.Tensor:
    """A run's last `keep` conv inputs [keep, C] float32, front-padded with zeros when the run is shorter."""
    rows = mixed[max(run.row, run.row + run.length - keep) : run.row + run.length].float()
    return torch.cat([rows.new_zeros(keep - rows.shape[0], rows.shape[1]), rows])


def _by_run(plans, gathered: list[list[torch.Tensor]]) -> dict[Run, torch.Tensor]:
    """Each rank's gathered pieces back to their runs: a rank's pieces are its runs in request, then sequence
    order (as `pcp_prefill` lists them)."""
    taken = [iter(pieces) for pieces in gathered]
    return {run: next(taken[run.rank]) for _, runs in plans for run in runs}


def _run_from_zero(layer, halo: torch.Tensor, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, run: Run):
    """One run through the convolution (after its halo [K - 1, C]) and the delta rule from [0 | I] with values
    [v | 0] -> (outputs from a zero state [T, Hv, dv], their dependence on the initial state [T, Hv, dk], the
    run's [B | M] [Hv, dk, dv + dk])."""
    taps = torch.cat([halo, x.float()]).transpose(0, 1)  # [C, K - 1 + T]
    conv = torch.nn.functional.conv1d(taps.unsqueeze(0), layer.conv_weight.float().unsqueeze(1),
                                      groups=layer.conv_channels)[0]
    q, k, v = layer._heads(torch.nn.functional.silu(conv).transpose(0, 1).to(x.dtype))
    hv, dk, dv = layer.hv, layer.dk, layer.dv
    values = torch.cat([v, v.new_zeros(run.length, hv, dk)], dim=-1)  # [T, Hv, dv + dk]
    eye = torch.eye(dk, dtype=torch.float32, device=x.device).expand(hv, dk, dk)
    start = torch.cat([eye.new_zeros(hv, dk, dv), eye], dim=-1)  # [Hv, dk, dv + dk]: S = 0, the identity beside
    rows = slice(run.row, run.row + run.length)
    out, end = layer.chunk_rule(q, k, values, g[rows], beta[rows], start)
    return out[..., :dv], out[..., dv:], end

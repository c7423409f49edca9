"""The state updates every delta-rule layer shares (gated DeltaNet, Kimi delta attention): single tokens by the
recurrent step, prompt chunks by the chunked rule or, split over PCP ranks, the state scan (pcp_prefill.py).

A layer mixes `DeltaStateUpdates` in and provides: `step_rule` and `chunk_rule` (its rule's two forms), `_heads`
(convolved channels -> q, k, v), `linear.conv_kernel`, `conv_channels`, `conv_weight` [channels, taps], `hv`,
`dk`, `dv` and `pcp`. The state of a request lives in the layer's pools at its state slot: the convolution's
last conv_kernel - 1 inputs and one rule matrix per head. A chunk at position 0 starts from zeros (a fresh
request, or one preempted and recomputed), any other from the slot's state (a prefix hit's restored snapshot
included), and leaves its own state there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.layers.gated_delta.pcp_prefill import pcp_prefill


class DeltaStateUpdates:
    """Runs one step's new tokens through a delta-rule layer's state; see the module docstring for what the layer
    provides."""

    def _update_states(self, meta, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state,
                       core: torch.Tensor) -> None:
        """Every request's new tokens of this step: mixed [N, channels], g [N, H] or [N, H, dk], beta [N, H];
        writes each token's rule output into core [N, H, dv]."""
        singles = [r for r in meta.requests if r.local_chunks and r.num_new == 1]
        if singles:
            self._step(singles, mixed, g, beta, state, core)
        prompts = [r for r in meta.requests if r.num_new > 1]
        if prompts and self.pcp.size > 1:  # every PCP rank calls it alike: its collectives follow the metadata
            pcp_prefill(self, prompts, mixed, g, beta, state, core)
        for request in prompts if self.pcp.size == 1 else ():
            for run in request.local_chunks:
                known = run.length - request.num_draft_tokens  # a verify chunk's drafts leave the state as it was
                self._chunk(request, run.row, known, mixed, g, beta, state, core)
                if request.num_draft_tokens:
                    self._chunk(request, run.row + known, request.num_draft_tokens, mixed, g, beta, state, core,
                                fresh=False, commit=False)

    def _step(self, requests, mixed, g, beta, state, core) -> None:
        """Single new tokens of several requests: one convolution tap window and one recurrent step each."""
        conv_pool, matrix_pool = state
        rows = torch.tensor([r.local_chunks[0].row for r in requests], device=mixed.device)
        slots = torch.tensor([r.state_slot for r in requests], device=mixed.device)
        fresh = torch.tensor([r.start_pos == 0 for r in requests], device=mixed.device)
        window = conv_pool.index_select(0, slots).masked_fill(fresh[:, None, None], 0.0)  # [B, C, K - 1]
        taps = torch.cat([window, mixed.index_select(0, rows).float().unsqueeze(-1)], dim=-1)  # [B, C, K]
        x = F.silu((taps * self.conv_weight.float()).sum(-1)).to(mixed.dtype)  # [B, C]
        q, k, v = self._heads(x)
        matrix = matrix_pool.index_select(0, slots).masked_fill(fresh[:, None, None], 0.0)
        matrix = matrix.view(len(requests), self.hv, self.dk, self.dv)
        # matrix is this step's gathered copy: the step may write over it
        out, matrix = self.step_rule(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), matrix,
                                     overwrite=True)
        core.index_copy_(0, rows, out)
        conv_pool.index_copy_(0, slots, taps[..., 1:])
        matrix_pool.index_copy_(0, slots, matrix.reshape(len(requests), self.hv, -1))

    def _chunk(self, request, row: int, length: int, mixed, g, beta, state, core, *, fresh: bool | None = None,
               commit: bool = True) -> None:
        """`length` new tokens of one request from row `row`: the convolution over its window and tokens, the
        chunked rule. `fresh`: start from zeros (default: the chunk starts at position 0); `commit`: leave the
        state after them in the slot (False for a verify chunk's drafts: they are scored from the state after the
        known tokens, which stays, so a rejected draft leaves no trace; docs/context_parallel.md, "Speculative
        decoding on hybrids")."""
        conv_pool, matrix_pool = state
        slot, keep = request.state_slot, self.linear.conv_kernel - 1
        fresh = not request.start_pos if fresh is None else fresh
        x = mixed[row : row + length].float().transpose(0, 1)  # [C, T]
        window = torch.zeros_like(conv_pool[slot]) if fresh else conv_pool[slot]
        taps = torch.cat([window, x], dim=-1)  # [C, K - 1 + T]
        conv = F.conv1d(taps.unsqueeze(0), self.conv_weight.float().unsqueeze(1), groups=self.conv_channels)[0]
        q, k, v = self._heads(F.silu(conv).transpose(0, 1).to(mixed.dtype))
        matrix = matrix_pool[slot].view(self.hv, self.dk, self.dv)
        if fresh:
            matrix = torch.zeros_like(matrix)
        out, matrix = self.chunk_rule(q, k, v, g[row : row + length], beta[row : row + length], matrix)
        core[row : row + length] = out
        if not commit:
            return
        conv_pool[slot] = taps[:, taps.shape[1] - keep:]
        matrix_pool[slot] = matrix.reshape(self.hv, -1)

"""The replica driver's part of disaggregation (torch-free): marks requests from their kv_transfer_params, holds a
producer's prefilled blocks until a consumer releases them or the abort timeout passes, answers the producer's
control port (its layout, releases) and tells producers when a consumer's pull is done."""

from __future__ import annotations

import logging
import threading
import time

from cpllm.disagg.config import KVTransferConfig
from cpllm.disagg.params import PullOp, RemotePrefill, producer_answer, remote_prefill, wants_remote_decode
from cpllm.disagg.reshard import CacheLayout
from cpllm.disagg.wire import Server, TransferError, call

logger = logging.getLogger(__name__)

IDLE_RELEASE_S = 0.5
"""How often an idle producer's engine steps (LLMEngine.idle_tick_s), so held blocks are freed on time."""


class EngineTransfer:
    """What one LLMEngine does for kv_transfer_config."""

    def __init__(self, config: KVTransferConfig, layout: CacheLayout, about_model: dict):
        """`about_model`: what a consumer checks its own model against (model_signature)."""
        self.config = config
        self._about = {"engine_id": config.engine_id, "layout": layout.to_dict(), **about_model}
        self._lock = threading.Lock()
        self._deadlines: dict[str, float] = {}
        """Held request id -> the monotonic time its blocks are freed unless released before."""
        self._released: set[str] = set()
        self.num_expired = 0
        """Held requests freed by the abort timeout (nobody pulled them), since start."""
        self.server = (Server(config.kv_ip, config.kv_port, self._serve, "kv-control")
                       if config.produces else None)

    # ---- requests ---------------------------------------------------------------------------------------

    def marks(self, params: dict | None, n: int) -> tuple[RemotePrefill | None, bool]:
        """(Request.kv_pull, Request.kv_hold) of a new request from its kv_transfer_params."""
        remote = remote_prefill(params)
        hold = wants_remote_decode(params)
        if (remote is not None or hold) and n != 1:
            raise ValueError(f"kv_transfer_params with n={n}: a disaggregated request has one sequence")
        if remote is not None and not self.config.consumes:
            raise ValueError(f"do_remote_prefill on an instance with kv_role={self.config.kv_role!r}")
        if hold and not self.config.produces:
            raise ValueError(f"do_remote_decode on an instance with kv_role={self.config.kv_role!r}")
        return remote, hold

    def answer(self, request_id: str, held_tables: list[list[int]] | None, state_slot: int = -1) -> dict | None:
        """The finished producer request's kv_transfer_params (its blocks, and its states' held slot, now held),
        once; None otherwise."""
        if held_tables is None:
            return None
        with self._lock:
            if request_id not in self._deadlines:
                self._deadlines[request_id] = time.monotonic() + self.config.abort_timeout_s
        return producer_answer(self.config, request_id, held_tables, self._about["layout"]["tp"], state_slot)

    def due(self) -> list[str]:
        """Held requests to free now: released by their consumer, or past the abort timeout."""
        now = time.monotonic()
        with self._lock:
            expired = [r for r, t in self._deadlines.items() if t <= now and r not in self._released]
            done = sorted(self._released & set(self._deadlines)) + expired
            for request_id in done:
                self._deadlines.pop(request_id)
            self._released.clear()
        if expired:
            self.num_expired += len(expired)
            logger.warning("kv transfer: freed %d prefilled requests nobody pulled within %.0f s: %s",
                           len(expired), self.config.abort_timeout_s, expired)
        return done

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._deadlines)

    # ---- the consumer's side ------------------------------------------------------------------------------

    def pulled(self, ops: tuple[PullOp, ...]) -> None:
        """Every rank has its rows (the step ran): the producers may free the blocks. A lost release costs the
        producer its abort timeout, not a failure here."""
        for op in ops:
            r = op.remote
            try:
                call(r.host, r.port, {"op": "release", "request_id": r.request_id},
                     timeout_s=self.config.transfer_timeout_s)
            except TransferError as error:
                logger.warning("kv transfer: release of %s on %s:%d failed (%s)", r.request_id, r.host, r.port, error)

    # ---- the producer's control port ----------------------------------------------------------------------

    def _serve(self, header: dict, frames: list) -> tuple[dict, list]:
        op = header.get("op")
        if op == "layout":
            return dict(self._about), []
        if op == "lease":  # a consumer rank is about to read: the blocks must still be held, and stay so a while
            with self._lock:
                request_id = header["request_id"]
                if request_id not in self._deadlines or request_id in self._released:
                    raise ValueError(f"request {request_id!r} is not held here (released, expired after "
                                     f"{self.config.abort_timeout_s} s, or never prefilled)")
                self._deadlines[request_id] = max(self._deadlines[request_id],
                                                  time.monotonic() + self.config.abort_timeout_s)
            return {"held": True}, []
        if op == "release":
            with self._lock:
                held = header["request_id"] in self._deadlines
                if held:
                    self._released.add(header["request_id"])
            return {"held": held}, []
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def engine_transfer(config) -> EngineTransfer | None:
    """The driver's EngineTransfer under `config.kv_transfer_config` (an EngineConfig), else None."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    layout = CacheLayout(dims=config.parallel.dims, interleave=config.parallel.cp_kv_cache_interleave_size,
                         block_size=config.cache.block_size)
    return EngineTransfer(kv, layout, model_signature(config))


def model_signature(config) -> dict:
    """What two instances' models must share for rows to move between them (an EngineConfig's): the KV heads,
    the layers, each KV group's window and layers, and the layers keeping a state."""
    from cpllm.kv_groups import kv_groups  # the layer registry: torch-free
    from cpllm.layers.registry import state_layer_indices

    groups = kv_groups(config.model, config.scheduler.max_model_len)
    return {"num_kv_heads": config.model.num_key_value_heads, "num_layers": config.model.num_hidden_layers,
            "groups": [[g.window, list(g.layers)] for g in groups],
            "state_layers": sorted(state_layer_indices(config.model))}


def request_marks(transfer: EngineTransfer | None, sampling_params) -> tuple[RemotePrefill | None, bool]:
    """(kv_pull, kv_hold) of a request from `SamplingParams.extra_args["kv_transfer_params"]`, checked before the
    engine files the request; asking for a transfer without kv_transfer_config is refused."""
    params = (sampling_params.extra_args or {}).get("kv_transfer_params")
    if transfer is not None:
        remote, hold = transfer.marks(params, sampling_params.n)
        if remote is not None and sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs with do_remote_prefill: the prompt was computed on the prefill "
                             "instance (ask it there)")
        return remote, hold
    if params and (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config (--kv-transfer-config)")
    return None, False

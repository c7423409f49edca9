"""`--kv-transfer-config`: vLLM's JSON object, the connector cpllm ships (CpllmConnector) and its role."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CONNECTOR = "CpllmConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
EXTRA_KEYS = ("transfer_timeout_s", "abort_timeout_s", "shared_memory")
"""What `kv_connector_extra_config` may set."""
KNOWN_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_connector_extra_config",
              "kv_buffer_device")


@dataclass(kw_only=True, frozen=True, slots=True)
class KVTransferConfig:
    """How this instance takes part in disaggregated prefill/decode (docs/disaggregated.md)."""

    kv_role: str
    """kv_producer: prefills requests marked do_remote_decode and keeps their blocks for a consumer to pull;
    kv_consumer: pulls a prefilled prompt's K/V for requests marked do_remote_prefill; kv_both: either."""
    kv_ip: str = "127.0.0.1"
    """Address the producer's sockets bind and announce (remote_host)."""
    kv_port: int = 14579
    """The producer's control port (remote_port); rank r of its replica serves rows on kv_port + 1 + r."""
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names this instance in kv_transfer_params (remote_engine_id)."""
    transfer_timeout_s: float = 30.0
    """Longest a consumer waits for one answer of the producer before it fails the pull."""
    abort_timeout_s: float = 120.0
    """A producer frees the blocks of a prefilled request nobody pulled within this many seconds."""
    shared_memory: bool = True
    """Rows between a producer and a consumer on one host (the same kernel and /dev/shm) go through /dev/shm
    instead of TCP (cpllm/disagg/shm_rows.py); False: TCP always."""

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role={self.kv_role!r}; choose one of {ROLES}")
        if not isinstance(self.kv_port, int) or not 1 <= self.kv_port <= 65535 - 64:
            raise ValueError(f"kv_port={self.kv_port!r} must be an integer in [1, {65535 - 64}] (rank r serves "
                             "on kv_port + 1 + r)")
        for name in ("transfer_timeout_s", "abort_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"shared_memory={self.shared_memory!r} must be true or false")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def rank_port(self, rank: int) -> int:
        """The port replica rank `rank` serves its rows on."""
        return self.kv_port + 1 + rank


def kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """vLLM's `--kv-transfer-config` (a JSON string or a dict) as a KVTransferConfig; None stays None."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key {unknown[0]!r}; known: {KNOWN_KEYS}")
    if value.get("kv_connector") != CONNECTOR:
        raise ValueError(f"kv_transfer_config: kv_connector={value.get('kv_connector')!r}; cpllm ships "
                         f"{CONNECTOR!r} only")
    extra = dict(value.get("kv_connector_extra_config") or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r}; known: {EXTRA_KEYS}")
    fields = {k: value[k] for k in ("kv_role", "kv_ip", "kv_port", "engine_id") if k in value}
    if "kv_role" not in fields:
        raise ValueError(f"kv_transfer_config needs kv_role, one of {ROLES}")
    if "engine_id" in fields:
        fields["engine_id"] = str(fields["engine_id"])
    return KVTransferConfig(**fields, **extra)


def check_disagg(config) -> None:
    """What a disaggregated instance cannot do yet, refused at configuration time (`config`: an EngineConfig)."""
    kv = config.kv_transfer_config
    if config.parallel.data_parallel_size != 1:
        raise ValueError(f"kv_transfer_config with data_parallel_size={config.parallel.data_parallel_size}: run "
                         "one instance per replica (each has its own kv_port)")
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":  # prompt lookup keeps no cache: it drafts from the tokens
        raise ValueError(f"kv_transfer_config ({kv.kv_role}) with speculative_config method={spec.method!r}: a "
                         "draft model's K/V is not transferred (method 'ngram' is allowed)")

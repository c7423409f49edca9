"""The router's settings (`cpllm router` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class RouterConfig:
    """Where the instances are and how long the router waits for them."""

    prefill_urls: tuple[str, ...]
    """Base URLs of the prefill instances (`cpllm serve ... --kv-transfer-config` with kv_producer or kv_both)."""
    decode_urls: tuple[str, ...]
    """Base URLs of the decode instances (kv_consumer or kv_both)."""
    request_timeout_s: float = 600.0
    """Longest wait for an instance's answer, or between two chunks of a stream."""
    connect_timeout_s: float = 5.0
    """Longest wait to connect to an instance; past it the instance counts as down for this request."""
    health_interval_s: float = 2.0
    """How often each instance's /health is polled in the background (an instance marked down comes back), and a
    healthy one's /metrics for its queue depth."""
    health_timeout_s: float = 2.0
    """Longest wait for one instance's /health answer, and for its /metrics."""

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"{name} is empty: give at least one URL (--{name.split('_')[0]} URL)")
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"{name}: {bad[0]!r} is not an http:// or https:// URL")
            object.__setattr__(self, name, tuple(u.rstrip("/") for u in urls))
        for name in ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")

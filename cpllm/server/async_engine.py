"""The engine's step loop on one background thread, fed from the asyncio event loop.

The engine is not thread-safe, so exactly one thread (started here) calls it.
Requests and aborts reach that thread through one FIFO queue, so an abort can
never overtake the request it cancels. Outputs go back through one asyncio queue
per request; RequestOutputs are cumulative, so a reader that fell behind keeps
only the newest one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from cpllm.engine.engine import LLMEngine
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine.replica_link import ReplicaHealth
from cpllm.server.health import HealthReport
from cpllm.server.metrics import ServerMetrics
from cpllm.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_ACCEPTED = object()
"""Posted to a request's queue once the engine took it (add_request did not raise)."""


class EngineDeadError(RuntimeError):
    """The step loop failed (for example a worker rank died); no request can be served any more."""


@dataclasses.dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    outputs: asyncio.Queue


@dataclasses.dataclass(slots=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(slots=True)
class _EndAll:
    message: str


class _Stop:
    pass


class AsyncEngine:
    """Async front of an LLMEngine: `add_request` returns a stream of outputs while the thread steps the engine."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        parallel = engine.config.parallel
        self.running_slots = engine.config.scheduler.max_num_seqs * parallel.data_parallel_size
        """Sequences the engine runs at once (max_num_seqs on each DP replica)."""
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # touched by the engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        """Makes "is the thread still taking requests?" and the put into its inbox one step."""
        self.error: BaseException | None = None
        """Why the step loop died, or None while it is healthy."""
        executor = getattr(engine, "executor", None)  # an isolated DP front has none: it reports per replica
        self._ranks = list(executor.replica_ranks) if executor is not None else []
        self._pcp = parallel.prefill_context_parallel_size
        self._idle_tick_s: float | None = getattr(engine, "idle_tick_s", None)
        """How often to step an idle engine that must watch its replicas (None: block until a command comes)."""
        if hasattr(engine, "collect_failures"):
            engine.collect_failures = True  # requests its failed replicas had started are failed here, one by one
        self._workers = getattr(executor, "workers", None)
        """The spawned ranks of a single replica (None for one rank, or when the engine reports its replicas)."""
        self._step_deadline_s = parallel.distributed_timeout_s
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called (on the engine thread) when the step loop fails: no replica can serve any more."""

    # ---- event-loop side ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self._workers is not None and not hasattr(self.engine, "replica_health"):
            self._workers.arm_watchdog(self._step_deadline_s)  # from here on every step has a deadline
        self._publish_state()
        self._thread = threading.Thread(target=self._run, name="cpllm-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return not self._closed and self._thread is not None and self._thread.is_alive()

    def health(self) -> HealthReport:
        """Every replica's state and why the engine stopped, if it did (thread-safe: reads only)."""
        error = None
        if not self.healthy:
            error = repr(self.error) if self.error is not None else "it has stopped"
        if hasattr(self.engine, "replica_health"):
            return HealthReport(replicas=tuple(self.engine.replica_health()), error=error)
        problems = tuple(self._workers.problems()) if self._workers is not None else ()
        state = "failed" if error is not None else "unhealthy" if problems else "serving"
        return HealthReport(replicas=(ReplicaHealth(0, state, problems),), error=error)

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                          prompt: str | None = None, arrival_time: float | None = None) -> "RequestStream":
        """Hands the request to the engine thread and waits until the engine took it.

        Raises ValueError when the engine refuses the request (prompt too long, bad
        token id) and EngineDeadError when the step loop is not running.
        """
        outputs: asyncio.Queue = asyncio.Queue()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        with self._close_lock:
            if self._closed or self._thread is None:
                raise EngineDeadError(f"the engine is not running (error: {self.error!r})")
            self._inbox.put(_Add(request_id, list(prompt_token_ids), params, prompt, arrival, outputs))
        try:
            _raise_if_error(await outputs.get())
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, outputs)

    async def compile_constraint(self, params: StructuredOutputsParams) -> None:
        """Compiles a structured-output grammar on a worker thread (ValueError if invalid), so the engine thread
        finds it in the cache instead of stalling every stream while it compiles."""
        await asyncio.to_thread(self.engine.structured.check, params)

    def abort(self, request_id: str) -> None:
        """Thread-safe; aborting an unknown or finished request does nothing."""
        self._inbox.put(_Abort(request_id))

    def end_all(self, message: str) -> None:
        """Thread-safe: aborts every request in flight; each stream fails with EngineDeadError(message)."""
        self._inbox.put(_EndAll(message))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Aborts what is left, stops the thread and the worker ranks (blocking; call via to_thread)."""
        if self._thread is None:
            self.engine.shutdown()
            return
        self._inbox.put(_Stop())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout_s)

    # ---- engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests() or self._idle_tick_s is not None:
                    self._deliver(self.engine.step())
                    self._fail_requests()
                self._publish_state()
        except BaseException as exc:  # noqa: BLE001 - every waiting request must learn about it
            logger.exception("engine step loop failed")
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc}"))
            if self.on_failure is not None:
                self.on_failure(exc)
        finally:
            self._close_inbox()
            self._abort_all()
            self._publish_state()
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - already stopping; say why and go on
                logger.exception("engine shutdown failed")

    def _handle_commands(self, block: bool) -> bool:
        """Applies every queued command (waiting for one when idle); False once asked to stop."""
        try:
            command = self._inbox.get(timeout=self._idle_tick_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _EndAll):
                self._end_all(command.message)
            else:
                self.engine.abort_request(command.request_id)
                self._streams.pop(command.request_id, None)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    prompt=command.prompt, arrival_time=command.arrival_time)
        except ValueError as exc:
            self._post([(command.outputs, exc)])
            return
        self._streams[command.request_id] = command.outputs
        self._post([(command.outputs, _ACCEPTED)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            batch.append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
        if batch:
            self._post(batch)

    def _post(self, batch: list[tuple[asyncio.Queue, object]]) -> None:
        """One wake-up of the event loop per step, however many requests advanced."""
        def put_all():
            for stream, item in batch:
                stream.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _end_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        if streams:
            logger.warning("ending %d request(s) still running: %s", len(streams), message)
        for request_id in streams:
            self.engine.abort_request(request_id)
        self._post([(stream, EngineDeadError(message)) for stream in streams.values()])

    def _fail_requests(self) -> None:
        """Ends each request the engine gave up on (its replica failed after it had sent tokens)."""
        if not hasattr(self.engine, "take_failures"):
            return
        batch = [(stream, EngineDeadError(message)) for request_id, message in self.engine.take_failures()
                 if (stream := self._streams.pop(request_id, None)) is not None]
        if batch:
            self._post(batch)

    def _fail_all(self, error: BaseException) -> None:
        self._post([(stream, error) for stream in self._streams.values()])

    def _close_inbox(self) -> None:
        """Refuses new requests and fails those still queued, so that no caller waits forever."""
        with self._close_lock:
            self._closed = True
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                why = f"the engine failed: {self.error}" if self.error is not None else "the server is shutting down"
                self._post([(command.outputs, EngineDeadError(why))])

    def _abort_all(self) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - best effort while stopping
                logger.exception("abort of %s failed", request_id)
        self._post([(stream, EngineDeadError("the server is shutting down")) for stream in streams.values()])

    def _publish_state(self) -> None:
        if self.metrics is None:
            return
        engine = self.engine
        if hasattr(engine, "rank_kv_usage"):  # every rank of every replica
            per_rank = engine.rank_kv_usage()
        else:  # one replica: its ranks share block ids
            per_rank = {rank: engine.kv_cache_usage for rank in self._ranks}
        self.metrics.set_engine_state(engine.num_running, engine.num_waiting, engine.kv_cache_usage, per_rank,
                                      engine.scheduler_totals)
        self.metrics.set_replicas(self.health().replicas, getattr(engine, "requeued", 0),
                                  getattr(engine, "ended_by_failure", 0))
        if self._pcp > 1:  # without PCP no step chooses a strategy
            counts = (engine.strategy_counts() if hasattr(engine, "strategy_counts")
                      else engine.executor.rank_stats().strategy_counts)
            self.metrics.set_strategy_counts(counts)


def _raise_if_error(item) -> None:
    if isinstance(item, BaseException):
        raise item


class RequestStream:
    """The outputs of one accepted request: `async for output in stream`, the last one finished.

    `close()` (always call it, e.g. in a finally) aborts the request if it has not
    finished, which frees its KV blocks, and records its metrics.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self.request_id = request_id
        self.last: RequestOutput | None = None
        """The newest output seen, or None before the first."""
        self._engine = engine
        self._outputs = outputs
        self._closed = False
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once, when the stream closes (finished, failed or abandoned)."""
        self._on_close.append(callback)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._outputs.get()
        while not self._outputs.empty():  # outputs are cumulative: only the newest matters
            _raise_if_error(item)
            item = self._outputs.get_nowait()
        _raise_if_error(item)
        self.last = item
        return item

    async def result(self) -> RequestOutput:
        """The finished output."""
        async for _ in self:
            pass
        return self.last

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._engine.abort(self.request_id)
        if self.last is not None and self._engine.metrics is not None:
            self._engine.metrics.observe_finished(self.last)
        for callback in self._on_close:
            callback()

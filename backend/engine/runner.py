"""The engine loop behind the HTTP server: one thread owns the engine (`EngineRunner`).

Threading
---------
The engine is not thread-safe, so one thread, the *loop*, owns it and every `Request` it runs:

    handler --call(fn)--> queue.SimpleQueue --> loop: fn(engine) --> concurrent Future --> handler
                                                 | Engine.step() while work exists
    handler <-- its asyncio.Queue <-- post(Delta) (call_soon_threadsafe) per request a step changed

- A command is a function of the engine (add, abort, flush, read state) run on the loop between
  steps; its result or exception comes back through a `concurrent.futures.Future` that the caller
  awaits (`asyncio.wrap_future`). The loop blocks on the queue while the engine is idle; otherwise
  it runs every queued command, then one step, and repeats.
- After a step, each changed request's subscriber gets a `Delta`: the output ids and logprobs
  added since its previous delta, its finish reason and cache statistics. Handlers never read a
  `Request` the engine owns.
- After every round the loop publishes an immutable `Snapshot` (engine counters, page counts, queue
  lengths) that /metrics and /get_server_info read without locks. The loop observes the TTFT and
  latency histograms itself (prometheus_client metrics are thread-safe), so a request whose client
  left is still counted.
- If a step raises, the loop logs it, posts a `Failure` (500) to every in-flight request, fails the
  queued commands with `EngineUnavailable` and exits; `stop` does the same with 503.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backend.engine.engine import Engine, Request

__all__ = ["Delta", "EngineRunner", "EngineUnavailable", "Failure", "ServerArgs", "Snapshot", "TextCodec"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
# SGLang's TTFT buckets (metrics_collector.py) with finer ones below 0.1 s for small CPU models.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 100, 200,
                   400)  # fmt: skip


class EngineUnavailable(RuntimeError):
    """The engine loop is not running (not started, stopped, or failed)."""


@dataclass(frozen=True, slots=True)
class TextCodec:
    """The model's tokenizer as two functions (the loop calls `decode` to find stop strings)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    """Ids to text with special tokens skipped (SGLang's default ``skip_special_tokens=True``)."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """What /get_model_info and /get_server_info report besides the engine's own `EngineConfig`."""

    model_path: str
    tokenizer_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    threads: int | None = None
    """torch intra-op threads, set when the loop starts; None leaves torch's setting alone."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Engine counters and cache occupancy after a loop round (safe to read from any thread)."""

    prompt_tokens: int
    cached_tokens: int
    recomputed_hole_tokens: int
    host_loaded_tokens: int
    evicted_tokens: int
    offloaded_tokens: int
    generated_tokens: int
    running: int
    waiting: int
    page_size: int
    device_pages: int
    host_pages: int
    device_free_pages: int
    device_cached_pages: int
    device_protected_pages: int
    device_in_use_pages: int
    host_free_pages: int
    host_cached_pages: int

    @classmethod
    def of(cls, engine: Engine) -> Snapshot:
        m, config = engine.metrics, engine.cache.config
        return cls(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_tokens,
            recomputed_hole_tokens=m.recomputed_hole_tokens,
            host_loaded_tokens=m.host_loaded_tokens,
            evicted_tokens=m.evicted_tokens,
            offloaded_tokens=m.offloaded_tokens,
            generated_tokens=m.generated_tokens,
            running=len(engine.running),
            waiting=len(engine.waiting),
            page_size=config.page_size,
            device_pages=config.device_pages,
            host_pages=config.host_pages,
            **engine.cache.size_info()._asdict(),
        )

    @property
    def token_usage(self) -> float:
        """SGLang's ``token_usage``: pages held by requests (their own or locked cache) over capacity."""
        return (self.device_in_use_pages + self.device_protected_pages) / self.device_pages

    @property
    def kv_usage(self) -> float:
        """Pages in use by requests plus cached pages (evictable or not) over capacity."""
        return (self.device_in_use_pages + self.device_cached_pages) / self.device_pages


@dataclass(frozen=True, slots=True)
class Delta:
    """What the loop changed for one request; its lists are copies the receiver may keep."""

    output_ids: list[int]
    output_logprobs: list[float]
    prompt_logprobs: list[float | None] | None
    """All of them, in the request's first delta only."""
    finish_reason: dict[str, object] | None
    cached_tokens: int
    recomputed_hole_tokens: int
    host_loaded_tokens: int
    first_token_latency: float | None
    e2e_latency: float | None


@dataclass(frozen=True, slots=True)
class Failure:
    """The loop stopped (503) or failed (500) with the request in flight."""

    message: str
    status: int


Post = Callable[[Delta | Failure], None]
_Command = tuple[Callable[[Engine], Any], "concurrent.futures.Future[Any]"]


@dataclass(slots=True)
class _Subscriber:
    request: Request
    post: Post
    sent: int = 0
    delivered: bool = False


class EngineRunner:
    """Owns an `Engine` on one loop thread (module docstring); others talk to it through `call`."""

    def __init__(self, engine: Engine, codec: TextCodec, args: ServerArgs) -> None:
        self.engine = engine
        self.codec = codec
        self.args = args
        self.snapshot = Snapshot.of(engine)
        self.error: str | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(self))
        buckets, registry = LATENCY_BUCKETS, self.registry
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token (s).",
                               buckets=buckets, registry=registry)  # fmt: skip
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency (s).",
                              buckets=buckets, registry=registry)  # fmt: skip
        self._finished = Counter("sglang:num_requests", "Requests finished.", registry=registry)
        self._aborted = Counter("sglang:num_aborted_requests", "Requests aborted.", registry=registry)
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "is the loop running" checks against its shutdown
        self._subscribers: dict[str, _Subscriber] = {}
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Start the loop thread (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
                self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; in-flight requests get a 503 `Failure`."""
        with self._lock:
            thread = self._thread
            if thread is not None and self.error is None:
                self._commands.put(None)
        if thread is not None:
            thread.join(timeout_s)

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the loop between steps; the future holds its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or self.error is not None:
                future.set_exception(EngineUnavailable(self.error or "the engine loop is not running"))
            else:
                self._commands.put((fn, future))
        return future

    def submit(self, request: Request, post: Post) -> concurrent.futures.Future[None]:
        """Queue `request` (ValueError in the future if the engine refuses it); deltas go to `post`."""

        def add(engine: Engine) -> None:
            engine.add_request(request)
            self._subscribers[request.rid] = _Subscriber(request, post)

        return self.call(add)

    def abort(self, rid: str | None, only: Request | None = None) -> concurrent.futures.Future[int]:
        """Abort request `rid` (every request when None); with `only`, only if `rid` is still that
        object (a finished rid may belong to a newer request). The future holds how many stopped."""

        def run(engine: Engine) -> int:
            if rid is None:
                targets = list(self._subscribers.values())
            else:
                targets = [
                    s for s in [self._subscribers.get(rid)] if s and (only is None or s.request is only)
                ]
            for subscriber in targets:
                engine.abort(subscriber.request.rid)
                self._deliver(subscriber)
            return len(targets)

        return self.call(run)

    def _run(self) -> None:
        if self.args.threads is not None:
            torch.set_num_threads(self.args.threads)
        try:
            while self._run_commands(block=not self.engine.has_work):
                if self.engine.has_work:
                    self._step()
                self.snapshot = Snapshot.of(self.engine)
        except Exception as exc:  # the engine's state is unknown now: fail everyone and stop
            logger.exception("engine loop failed")
            self._shut_down(f"engine loop failed: {exc!r}", 500)
        else:
            self._shut_down("the engine loop has stopped", 503)

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            item = self._commands.get() if block else self._commands.get_nowait()
            while item is not None:
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:  # the caller's to handle (ValueError: a bad request)
                        future.set_exception(exc)
                item = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _step(self) -> None:
        changed = self.engine.step()
        for request in changed:
            self._deliver(self._subscribers[request.rid])
        if not changed and not self.engine.running and self.engine.waiting:
            # NOTE: validation should make this impossible: an idle cache can hold any valid request.
            for request in list(self.engine.waiting):
                self.engine.abort(request.rid)
                request.finish_reason = {"type": "abort", "status_code": 500,
                                         "message": "the engine cannot admit this request"}  # fmt: skip
                self._deliver(self._subscribers[request.rid])

    def _deliver(self, subscriber: _Subscriber) -> None:
        request, sent = subscriber.request, subscriber.sent
        ttft = None if request.first_token_s is None else request.first_token_s - request.arrival_s
        e2e = None if request.finish_s is None else request.finish_s - request.arrival_s
        if ttft is not None and sent == 0 and request.output_ids:
            self._ttft.observe(ttft)
        delta = Delta(
            output_ids=request.output_ids[sent:],
            output_logprobs=request.output_logprobs[sent:],
            prompt_logprobs=None if subscriber.delivered else list(request.prompt_logprobs),
            finish_reason=None if request.finish_reason is None else dict(request.finish_reason),
            cached_tokens=request.cached_tokens,
            recomputed_hole_tokens=request.recomputed_hole_tokens,
            host_loaded_tokens=request.host_loaded_tokens,
            first_token_latency=ttft,
            e2e_latency=e2e,
        )
        subscriber.sent, subscriber.delivered = len(request.output_ids), True
        if request.finish_reason is not None:
            del self._subscribers[request.rid]
            self._finished.inc()
            self._e2e.observe(e2e or 0.0)
            if request.finish_reason["type"] == "abort":
                self._aborted.inc()
        subscriber.post(delta)

    def _shut_down(self, message: str, status: int) -> None:
        with self._lock:
            self.error = message
            while True:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(EngineUnavailable(message))
        for subscriber in self._subscribers.values():
            subscriber.post(Failure(message, status))
        self._subscribers.clear()


class _SnapshotCollector(Collector):
    """Engine counters and gauges from the runner's latest `Snapshot` (names: server docstring)."""

    def __init__(self, runner: EngineRunner) -> None:
        self._runner = runner

    def collect(self) -> Iterable[Metric]:
        s = self._runner.snapshot
        yield CounterMetricFamily(
            "sglang:prompt_tokens_total", "Prompt tokens admitted.", value=s.prompt_tokens
        )
        yield CounterMetricFamily(
            "sglang:generation_tokens_total", "Tokens generated.", value=s.generated_tokens
        )
        cached = CounterMetricFamily("sglang:cached_tokens_total", "Prompt tokens reused, by source.",
                                     labels=["cache_source"])  # fmt: skip
        cached.add_metric(["device"], s.cached_tokens - s.host_loaded_tokens)
        cached.add_metric(["host"], s.host_loaded_tokens)
        yield cached
        yield CounterMetricFamily("sglang:load_back_tokens_total", "Prompt tokens loaded from the host tier.",
                                  value=s.host_loaded_tokens)  # fmt: skip
        yield CounterMetricFamily("loom_recomputed_hole_tokens_total", "Prompt tokens recomputed in place "
                                  "(holes).", value=s.recomputed_hole_tokens)  # fmt: skip
        yield CounterMetricFamily("loom_evicted_tokens_total", "KV tokens deleted from either tier.",
                                  value=s.evicted_tokens)  # fmt: skip
        yield CounterMetricFamily("loom_offloaded_tokens_total", "KV tokens moved from the device to "
                                  "the host tier.", value=s.offloaded_tokens)  # fmt: skip
        yield GaugeMetricFamily("sglang:num_running_reqs", "Running requests.", value=s.running)
        yield GaugeMetricFamily("sglang:num_queue_reqs", "Waiting requests.", value=s.waiting)
        yield GaugeMetricFamily("sglang:token_usage", "Device KV held by requests over capacity.",
                                value=s.token_usage)  # fmt: skip
        yield GaugeMetricFamily(
            "loom_kv_usage", "Device KV in use or cached over capacity.", value=s.kv_usage
        )
        yield GaugeMetricFamily("loom_kv_cached_tokens", "Device KV tokens cached.",
                                value=s.device_cached_pages * s.page_size)  # fmt: skip
        yield GaugeMetricFamily("loom_host_kv_cached_tokens", "Host KV tokens cached.",
                                value=s.host_cached_pages * s.page_size)  # fmt: skip


##### Command line #####

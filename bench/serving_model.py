"""A discrete-event model of one accelerator serving agent sessions through the cache-policy core.

Time is simulated, the cache is real: every request goes through `TieredCache` exactly as in the engine
(match -> plan -> lock -> admit -> insert -> unlock), so hits, holes, phantoms, loads and evictions are the
core's own decisions. Only the clock comes from models:

- prefill: `cost.prefill_seconds` of the positions computed in the step (phantom spans at their original
  positions, then the request's own tokens), with chunked prefill of at most `max_batch_tokens` per step;
- decode: `hardware.decode_s_per_step` per step; every decoding request emits one token per step, and a
  step that also prefills costs both;
- host transfers: `cost.transfer_seconds` of the pages an admission moves, added to its step.

Sessions: `num_slots` run at once, in the given order; a slot takes the next session when its session
ends. A session sends request i+1 when request i has finished decoding and `think_time_s * think_scale`
has passed. Scheduling: waiting requests are ordered by `lpm` (most reusable tokens first: device hits
plus host loads plus kept history after holes, like SGLang's longest-prefix-match counting host hits) or
`fcfs` (arrival order), and admitted in that order until one does not fit (no skipping, as in SGLang).
A request's pages for prompt plus output are reserved at admission; the prompt is inserted when its
prefill ends (the request then locks its new leaf while decoding) and the output is not cached: the
traces do not say which later blocks hold it. Requests larger than the device tier are skipped.

Recomputed tokens: prompt tokens a request computes that its session had computed before (its previous
prompt's common prefix with this one; for a first request, the tools + system prefix once any session
ran), i.e. work that eviction caused. Their cost is measured with the same cost model.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backend.cache import Admission, Span, TieredCache
from backend.cache.cost import Hardware, ModelShape, prefill_seconds, span_cost, transfer_seconds
from backend.cache.tree import Node
from bench.traces import Session
from gateway.session_stats import common_prefix_length

SCHEDULERS = ("lpm", "fcfs")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    num_slots: int = 4
    """Sessions running at once."""
    scheduler: str = "lpm"
    max_batch_tokens: int = 8192
    """Prefill tokens per step (chunked prefill)."""
    think_scale: float = 1.0
    max_requests: int | None = None
    """Stop issuing requests after this many (None: replay every session to its end)."""

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {self.num_slots}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.think_scale < 0:
            raise ValueError(f"think_scale must be >= 0, got {self.think_scale}")


@dataclass(slots=True)
class RequestRecord:
    """One served request, as the report needs it."""

    session_id: str
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float = 0.0
    finish_s: float = 0.0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    phantom_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_cost_units: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class _Live:
    """A request inside the server."""

    record: RequestRecord
    session: _SessionState
    tokens: list[int]
    seen_tokens: int
    admission: Admission | None = None
    locked: Node | None = None
    work: deque[Span] = field(default_factory=deque)
    decode_left: int = 0


@dataclass(slots=True)
class _SessionState:
    session: Session
    start_s: float
    next_index: int = 0
    previous_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SimulationResult:
    requests: list[RequestRecord]
    session_times_s: dict[str, float]
    skipped_requests: int
    makespan_s: float


class Simulator:
    def __init__(
        self,
        cache: TieredCache,
        shape: ModelShape,
        hardware: Hardware,
        config: ServingConfig,
        prompt_tokens: Callable[[Session, int], list[int]],
    ) -> None:
        self.cache = cache
        self.shape = shape
        self.hardware = hardware
        self.config = config
        self._prompt_tokens = prompt_tokens
        self._page = cache.page_size
        self.now = 0.0
        self._arrivals: list[tuple[float, int, _SessionState]] = []
        self._sequence = 0
        self._waiting: list[_Live] = []
        self._prefilling: list[_Live] = []
        self._decoding: list[_Live] = []
        self._pending_sessions: deque[Session] = deque()
        self._records: list[RequestRecord] = []
        self._session_times: dict[str, float] = {}
        self._issued = 0
        self._skipped = 0
        self._ran_any = False
        self._step_transfer_pages = 0
        self._changed = True  # something happened that may let a waiting request in

    def run(self, sessions: Sequence[Session]) -> SimulationResult:
        self._pending_sessions.extend(sessions)
        for _ in range(self.config.num_slots):
            self._start_next_session()
        while self._arrivals or self._waiting or self._prefilling or self._decoding:
            if not (self._waiting or self._prefilling or self._decoding):
                self.now = max(self.now, self._arrivals[0][0])
            self._receive_arrivals()
            self._schedule()
            if self._prefilling or self._decoding:
                self._step()
            elif self._waiting and not self._arrivals:
                raise RuntimeError("a waiting request can never be admitted; is it larger than the cache?")
        return SimulationResult(self._records, self._session_times, self._skipped, self.now)

    ##### Sessions and arrivals #####

    def _start_next_session(self) -> None:
        if not self._pending_sessions or self._out_of_requests():
            return
        state = _SessionState(self._pending_sessions.popleft(), self.now)
        self._queue_arrival(state, self.now)

    def _out_of_requests(self) -> bool:
        return self.config.max_requests is not None and self._issued >= self.config.max_requests

    def _queue_arrival(self, state: _SessionState, when: float) -> None:
        self._sequence += 1
        heapq.heappush(self._arrivals, (when, self._sequence, state))

    def _receive_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now:
            when, _, state = heapq.heappop(self._arrivals)
            self._issue(state, when)

    def _issue(self, state: _SessionState, when: float) -> None:
        if self._out_of_requests():
            return  # the run is over for this session; its time is not a completion time
        request = state.session.requests[state.next_index]
        pages = -(-(request.input_tokens + request.output_tokens) // self._page)
        if pages > self.cache.config.device_pages or request.input_tokens < 2:
            self._skipped += 1
            self._finish_session_request(state, when)
            return
        self._issued += 1
        tokens = self._prompt_tokens(state.session, state.next_index)
        seen = self._seen_tokens(state, tokens)
        record = RequestRecord(
            state.session.session_id, state.next_index, when, len(tokens), request.output_tokens
        )
        self._waiting.append(_Live(record, state, tokens, seen))
        self._changed = True

    def _seen_tokens(self, state: _SessionState, tokens: list[int]) -> int:
        if not state.previous_tokens:
            return min(state.session.shared_prefix_tokens, len(tokens)) if self._ran_any else 0
        common = common_prefix_length(state.previous_tokens, tokens)
        return common - common % self._page

    def _finish_session_request(self, state: _SessionState, when: float) -> None:
        state.next_index += 1
        requests = state.session.requests
        if state.next_index < len(requests):
            if not self._out_of_requests():
                think = requests[state.next_index].think_time_s * self.config.think_scale
                self._queue_arrival(state, when + think)
            return
        self._session_times[state.session.session_id] = when - state.start_s
        self._start_next_session()

    ##### Scheduling #####

    def _schedule(self) -> None:
        if not self._waiting or not self._changed:
            return
        self._changed = False
        planned = []
        for live in self._waiting:
            match = self.cache.match(live.tokens[:-1])
            planned.append((live, self.cache.plan(match, len(live.tokens))))
        if self.config.scheduler == "lpm":
            planned.sort(key=lambda item: -(item[1].cached_tokens + item[1].loaded_tokens))
        self._waiting = []
        for position, (live, _) in enumerate(planned):
            if not self._admit(live):
                self._waiting = [item[0] for item in planned[position:]]
                return

    def _admit(self, live: _Live) -> bool:
        self.cache.tick()
        # Earlier admissions in this round may have changed the tree: plan again before admitting.
        plan = self.cache.plan(self.cache.match(live.tokens[:-1]), len(live.tokens))
        reserve = live.record.output_tokens
        if not self.cache.can_admit(plan, reserve):
            return False
        self.cache.lock(plan.last_node)
        admission = self.cache.admit(plan, reserve)
        live.admission, live.locked = admission, plan.last_node
        live.work = deque([*plan.phantom_spans, plan.compute])
        self._step_transfer_pages += len(admission.eviction.transfers)
        record = live.record
        record.cached_tokens, record.loaded_tokens = plan.cached_tokens, plan.loaded_tokens
        record.phantom_tokens = plan.recomputed_tokens
        record.computed_tokens = plan.recomputed_tokens + plan.compute.num_tokens
        lost_end = max(plan.compute.start, min(live.seen_tokens, len(live.tokens)))
        record.recomputed_tokens = plan.recomputed_tokens + lost_end - plan.compute.start
        record.recompute_cost_units = sum(span_cost(self.shape, *s) for s in plan.phantom_spans) + span_cost(
            self.shape, plan.compute.start, lost_end
        )
        self._prefilling.append(live)
        self._ran_any = True
        return True

    ##### Steps #####

    def _step(self) -> None:
        chunk, finished_prefill = self._take_prefill_chunk()
        decoding = list(self._decoding)
        steps = 1
        if not chunk and decoding and not self._step_transfer_pages:
            steps = self._decode_steps_until_event(decoding)
        duration = prefill_seconds(self.shape, self.hardware, chunk)
        duration += transfer_seconds(self.shape, self.hardware, self._step_transfer_pages * self._page)
        if decoding:
            duration += steps * self.hardware.decode_s_per_step
        self._step_transfer_pages = 0
        self.now += duration
        for live in decoding:
            live.decode_left -= steps
            if live.decode_left <= 0:
                self._decoding.remove(live)
                self._finish(live)
        for live in finished_prefill:
            self._end_prefill(live)

    def _take_prefill_chunk(self) -> tuple[list[Span], list[_Live]]:
        budget = self.config.max_batch_tokens
        chunk: list[Span] = []
        finished: list[_Live] = []
        for live in self._prefilling:
            while live.work and budget > 0:
                span = live.work.popleft()
                take = min(budget, span.num_tokens)
                chunk.append(Span(span.start, span.start + take))
                if take < span.num_tokens:
                    live.work.appendleft(Span(span.start + take, span.end))
                budget -= take
            if not live.work:
                finished.append(live)
            if budget <= 0:
                break
        for live in finished:
            self._prefilling.remove(live)
        return chunk, finished

    def _decode_steps_until_event(self, decoding: list[_Live]) -> int:
        """Decode-only steps that can be taken at once: until a request finishes or one arrives."""
        steps = min(live.decode_left for live in decoding)
        if self._arrivals:
            until_arrival = (self._arrivals[0][0] - self.now) / self.hardware.decode_s_per_step
            steps = min(steps, max(1, int(until_arrival)))
        return max(1, steps)

    def _end_prefill(self, live: _Live) -> None:
        assert live.admission is not None and live.locked is not None
        live.record.first_token_s = self.now
        self._changed = True
        self.cache.tick()
        whole = len(live.tokens) // self._page
        prompt = live.tokens[: whole * self._page]
        self.cache.insert(prompt, live.admission.page_table[:whole])
        leaf = self.cache.match(prompt).last_node
        self.cache.lock(leaf)
        self.cache.unlock(live.locked)
        live.locked = leaf
        live.decode_left = live.record.output_tokens - 1
        if live.decode_left > 0:
            self._decoding.append(live)
        else:
            self._finish(live)

    def _finish(self, live: _Live) -> None:
        assert live.admission is not None and live.locked is not None
        whole = len(live.tokens) // self._page
        self.cache.free(live.admission.page_table[whole:])
        self.cache.unlock(live.locked)
        live.record.finish_s = self.now
        self._changed = True
        self._records.append(live.record)
        live.session.previous_tokens = live.tokens
        self._finish_session_request(live.session, self.now)

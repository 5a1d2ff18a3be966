"""The embedded engine: continuous batching over a paged KV pool, every cache decision by the core.

A request's life:

    add_request -> waiting -> admitted: match(prompt[:-1]) -> plan -> lock -> admit (evict, copy pages)
      -> prefill: chunks of its phantom spans, then its own tokens, at most `max_batch_tokens` per step
      -> first token; insert the prompt's whole pages; lock the new leaf
      -> decode: one token per step, batched with everything else running
      -> finish (stop, length, abort): insert prompt + output, free the rest, unlock

Each step builds one ragged batch (decode rows first, then prefill chunks in admission order) and runs
one forward: in every layer the batch writes its K/V first and then attends, so a request's phantom rows
(a hole recomputed at its original positions) are visible to its own new rows in the same step. Phantom
rows produce no logits. Waiting requests are admitted in `lpm` order (most reusable tokens first: device
hits + host loads + history kept after holes) or `fcfs`, until one does not fit (no skipping). A request
reserves pages for `max_new_tokens` at admission, so running requests never need retraction.

Prompt logprobs: with `logprob_start_len = s >= 0`, the match stops before position s - 1 so that the
logits predicting token s onward are computed, and `prompt_logprobs[i]` is log P(prompt[s + i]).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from backend.cache import CacheConfig, Handle, RestorePlan, Span, Tier, TieredCache
from backend.cache.tree import Node
from backend.engine.kv_pool import PagedKVPool
from backend.engine.model import ForwardBatch, SequenceView, Transformer
from backend.engine.sampling import SamplingParams, sample

SCHEDULE_POLICIES = ("lpm", "fcfs")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_cache_tokens: int = 65536
    page_size: int = 16
    host_kv_tokens: int = 0
    swap_buffer_tokens: int = 1024
    eviction_policy: str = "penelope"
    schedule_policy: str = "lpm"
    max_batch_tokens: int = 2048
    """Tokens per forward step: decode rows plus prefill chunks."""
    max_running_requests: int = 32
    deterministic: bool = False
    """Fixed-order kernels: outputs bit-identical whatever the batch composition (slower)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        if self.max_batch_tokens < 1 or self.max_running_requests < 1:
            raise ValueError("max_batch_tokens and max_running_requests must be at least 1")
        self.cache_config()  # validates sizes and the eviction policy name

    def cache_config(self) -> CacheConfig:
        from backend.cache.policies import POLICIES

        POLICIES.create(self.eviction_policy)
        return CacheConfig(
            device_tokens=self.kv_cache_tokens,
            page_size=self.page_size,
            host_tokens=self.host_kv_tokens,
            swap_buffer_tokens=self.swap_buffer_tokens if self.host_kv_tokens else 0,
            eviction_policy=self.eviction_policy,
        )


@dataclass(eq=False)
class Request:
    """A generation request and, once running, its place in the cache."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict[str, object] | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    recomputed_hole_tokens: int = 0
    host_loaded_tokens: int = 0
    # Running state.
    page_table: list[Handle] = field(default_factory=list)
    own_pages: set[Handle] = field(default_factory=set)
    locked: Node | None = None
    work: deque[Span] = field(default_factory=deque)
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V is in the pool: the prompt and every output token but the newest."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)


@dataclass(slots=True)
class EngineMetrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_hole_tokens: int = 0
    host_loaded_tokens: int = 0
    evicted_tokens: int = 0
    offloaded_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    """The most recent times to first token."""


@dataclass(slots=True)
class _Rows:
    """One request's rows in a step's batch."""

    request: Request
    start: int
    end: int
    spans: list[Span]
    decode: bool
    completes: bool = False
    """A prefill chunk that finishes the prompt: its last row gives the first output token."""
    logit_positions: list[int] = field(default_factory=list)
    logit_index: int = 0


class Engine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.decode = decode
        self.device = next(model.parameters()).device
        self.cache = TieredCache(config.cache_config())
        dtype = next(model.parameters()).dtype
        self.pool = PagedKVPool(model.config, self.cache.config, dtype, self.device)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.metrics = EngineMetrics()
        self._requests: dict[str, Request] = {}  # waiting and running, by rid
        self._num_added = 0

    ##### Public API #####

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for one that can never run (too long, bad ids, dup rid)."""
        self._validate(request)
        seed = request.params.seed
        if seed is None:
            seed = self.config.seed + self._num_added
        request.generator = torch.Generator().manual_seed(seed)
        self._num_added += 1
        self._requests[request.rid] = request
        self.waiting.append(request)

    def abort(self, rid: str) -> bool:
        """Stop a waiting or running request; returns False if it is unknown or already finished."""
        request = self._requests.get(rid)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.cache.free(sorted(request.own_pages))
            assert request.locked is not None
            self.cache.unlock(request.locked)
        self._finish(request, {"type": "abort"})
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """Admit what fits, run one forward, sample; returns requests with new tokens or finished."""
        self._admit_waiting()
        if not self.running:
            return []
        batch, rows = self._build_batch()
        logits = self.model(batch, self.pool.device, deterministic=self.config.deterministic)
        return self._advance(rows, logits)

    def run_until_idle(self) -> None:
        while self.has_work:
            if not self.step() and not self.running:
                raise RuntimeError("waiting requests can never be admitted")

    def generate(self, requests: Sequence[Request]) -> list[Request]:
        for request in requests:
            self.add_request(request)
        self.run_until_idle()
        return list(requests)

    def flush_cache(self) -> bool:
        """Drop every cached page; refused (False) while requests run."""
        if self.has_work:
            return False
        self.cache = TieredCache(self.config.cache_config())
        return True

    ##### Admission #####

    def _validate(self, request: Request) -> None:
        if request.rid in self._requests:
            raise ValueError(f"request id {request.rid!r} is already in use")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}), got {bad[:5]}")
        total = len(request.prompt_ids) + request.params.max_new_tokens
        if total > self.config.kv_cache_tokens:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens plus max_new_tokens "
                f"{request.params.max_new_tokens} exceeds the KV cache "
                f"({self.config.kv_cache_tokens} tokens)"
            )
        if total > self.model.config.max_position_embeddings:
            raise ValueError(
                f"prompt plus max_new_tokens ({total}) exceeds the model's "
                f"{self.model.config.max_position_embeddings} positions"
            )

    def _plan(self, request: Request) -> RestorePlan:
        prompt = request.prompt_ids
        reusable = len(prompt) - 1
        if request.return_logprob and request.logprob_start_len >= 0:
            reusable = min(reusable, max(request.logprob_start_len - 1, 0))
        return self.cache.plan(self.cache.match(prompt[:reusable]), len(prompt))

    def _admit_waiting(self) -> None:
        if not self.waiting:
            return
        self.cache.tick()
        candidates = [(request, self._plan(request)) for request in self.waiting]
        if self.config.schedule_policy == "lpm":
            candidates.sort(key=lambda item: -(item[1].cached_tokens + item[1].loaded_tokens))
        for request, _ in candidates:
            if len(self.running) >= self.config.max_running_requests:
                return
            plan = self._plan(request)  # earlier admissions may have changed the tree
            reserve = request.params.max_new_tokens
            if not self.cache.can_admit(plan, reserve):
                return
            self.cache.lock(plan.last_node)
            admission = self.cache.admit(plan, reserve)
            self.pool.run(admission.eviction.transfers)
            self._record_eviction(admission.eviction.deleted, admission.eviction.offloaded)
            request.page_table = list(admission.page_table)
            shared = {h for s in (*plan.reused, *plan.loads) for h in s.handles}
            request.own_pages = set(request.page_table) - shared
            request.locked = plan.last_node
            request.work = deque([*plan.phantom_spans, plan.compute])
            request.cached_tokens = plan.cached_tokens + plan.loaded_tokens
            request.recomputed_hole_tokens = plan.recomputed_tokens
            request.host_loaded_tokens = plan.loaded_tokens
            self.metrics.prompt_tokens += len(request.prompt_ids)
            self.metrics.cached_tokens += request.cached_tokens
            self.metrics.recomputed_hole_tokens += plan.recomputed_tokens
            self.metrics.host_loaded_tokens += plan.loaded_tokens
            self.waiting.remove(request)
            self.running.append(request)

    def _record_eviction(self, deleted: dict[Tier, list[Handle]], offloaded: list[Handle]) -> None:
        page = self.cache.page_size
        self.metrics.evicted_tokens += page * sum(len(handles) for handles in deleted.values())
        self.metrics.offloaded_tokens += page * len(offloaded)

    ##### Batching #####

    def _build_batch(self) -> tuple[ForwardBatch, list[_Rows]]:
        ids: list[int] = []
        positions: list[int] = []
        rows: list[_Rows] = []
        budget = self.config.max_batch_tokens
        for request in self.running:
            if request.work or budget <= 0:
                continue
            position = request.num_computed
            span = Span(position, position + 1)
            part = _Rows(request, len(ids), len(ids) + 1, [span], decode=True, logit_positions=[position])
            rows.append(part)
            ids.append(request.output_ids[-1])
            positions.append(position)
            budget -= 1
        for request in self.running:
            if not request.work or budget <= 0:
                continue
            start, spans = len(ids), []
            while request.work and budget > 0:
                span = request.work.popleft()
                take = min(budget, span.num_tokens)
                if take < span.num_tokens:
                    request.work.appendleft(Span(span.start + take, span.end))
                spans.append(Span(span.start, span.start + take))
                ids.extend(request.prompt_ids[span.start : span.start + take])
                positions.extend(range(span.start, span.start + take))
                budget -= take
            part = _Rows(request, start, len(ids), spans, decode=False, completes=not request.work)
            part.logit_positions = self._prefill_logit_positions(part)
            rows.append(part)
        return self._assemble(ids, positions, rows), rows

    def _prefill_logit_positions(self, part: _Rows) -> list[int]:
        """The prompt's last position if this chunk ends it, and positions whose logits give prompt
        logprobs. Phantom rows never qualify: they lie before the logprob start (see `_plan`)."""
        request, last = part.request, len(part.request.prompt_ids) - 1
        start = request.logprob_start_len if request.return_logprob else -1
        return [
            p
            for span in part.spans
            for p in range(span.start, span.end)
            if (p == last and part.completes) or (start >= 0 and start - 1 <= p < last)
        ]

    def _assemble(self, ids: list[int], positions: list[int], rows: list[_Rows]) -> ForwardBatch:
        write_slots: list[torch.Tensor] = []
        sequences: list[SequenceView] = []
        logit_rows: list[int] = []
        for part in rows:
            request = part.request
            write_slots.extend(self.pool.slots(request.page_table, s.start, s.end) for s in part.spans)
            context_len = part.spans[-1].end
            pages = request.page_table[: -(-context_len // self.cache.page_size)]
            context = torch.tensor(pages, dtype=torch.int64, device=self.device)
            sequences.append(SequenceView(part.start, part.end, context, context_len))
            row_of = {p: part.start + i for i, p in enumerate(positions[part.start : part.end])}
            part.logit_index = len(logit_rows)
            logit_rows.extend(row_of[p] for p in part.logit_positions)
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            write_slots=torch.cat(write_slots).to(self.device),
            sequences=sequences,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=self.device),
            page_size=self.cache.page_size,
        )

    ##### After the forward #####

    def _advance(self, rows: list[_Rows], logits: torch.Tensor) -> list[Request]:
        changed: list[Request] = []
        for part in rows:
            request = part.request
            part_logits = logits[part.logit_index : part.logit_index + len(part.logit_positions)]
            if not part.decode and request.return_logprob:
                self._prompt_logprobs(request, part, part_logits)
            if part.decode or part.completes:
                if part.completes:
                    self._end_prefill(request)
                self._emit(request, part_logits[-1])
                changed.append(request)
        return changed

    def _prompt_logprobs(self, request: Request, part: _Rows, part_logits: torch.Tensor) -> None:
        start, prompt = request.logprob_start_len, request.prompt_ids
        if start < 0:
            return
        if start == 0 and not request.prompt_logprobs:
            request.prompt_logprobs.append(None)
        for position, row_logits in zip(part.logit_positions, part_logits, strict=True):
            if start - 1 <= position < len(prompt) - 1:
                logprobs = torch.log_softmax(row_logits, dim=-1)
                request.prompt_logprobs.append(float(logprobs[prompt[position + 1]]))

    def _end_prefill(self, request: Request) -> None:
        request.first_token_s = time.perf_counter()
        self.metrics.ttft_s.append(request.first_token_s - request.arrival_s)
        self._cache_computed(request, request.prompt_ids)

    def _cache_computed(self, request: Request, tokens: list[int]) -> None:
        """Insert the whole pages of `tokens` (all computed) and point the request at the tree's pages."""
        page = self.cache.page_size
        whole = len(tokens) // page
        self.cache.tick()
        self.cache.insert(tokens[: whole * page], request.page_table[:whole])
        match = self.cache.match(tokens[: whole * page])
        request.page_table[:whole] = [h for segment in match.segments for h in segment.handles]
        request.own_pages = set(request.page_table[whole:])
        self.cache.lock(match.last_node)
        assert request.locked is not None
        self.cache.unlock(request.locked)
        request.locked = match.last_node

    def _emit(self, request: Request, logits: torch.Tensor) -> None:
        assert request.generator is not None
        token = sample(logits, request.params, request.generator)
        request.output_ids.append(token)
        if request.return_logprob:
            request.output_logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        self.metrics.generated_tokens += 1
        reason = self._stop_reason(request, token)
        if reason is not None:
            self._release(request)
            self._finish(request, reason)

    def _stop_reason(self, request: Request, token: int) -> dict[str, object] | None:
        params = request.params
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if not params.ignore_eos and token == self.model.config.eos_token_id:
            return {"type": "stop", "matched": token}
        if params.stop and self.decode is not None:
            # A stop string of n characters lies within the last n tokens (plus a few for tokens
            # that only complete a multi-byte character): decode just that tail, not the whole output.
            window = max(len(stop) for stop in params.stop) + 4
            text = self.decode(request.output_ids[-window:])
            for stop in params.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(request.output_ids)}
        return None

    def _release(self, request: Request) -> None:
        """Cache prompt + output (their computed whole pages), free the rest, unlock."""
        computed = (request.prompt_ids + request.output_ids)[: request.num_computed]
        self._cache_computed(request, computed)
        self.cache.free(sorted(request.own_pages))
        request.own_pages = set()
        assert request.locked is not None
        self.cache.unlock(request.locked)
        request.locked = None
        self.running.remove(request)

    def _finish(self, request: Request, reason: dict[str, object]) -> None:
        request.finish_reason = reason
        request.finish_s = time.perf_counter()
        del self._requests[request.rid]

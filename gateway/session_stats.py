"""Per-session bookkeeping: turns, tokens, cache hits and the *append ratio*, for the most recent sessions.

The append ratio of a request is the share of its prompt tokens that extend the session's previous
request, prompt and generated tokens together: `common_prefix(previous prompt + output, prompt) /
len(prompt)`. A coding agent whose turns are canonicalised well scores close to 1; anything that
rewrites earlier tokens (a volatile system block, reordered JSON, a re-tokenized reply) lowers it and
costs cache hits on every backend. A session's ratio is token-weighted over its turns after the first.

Sessions live in an LRU of `max_sessions` entries, so memory and metric label cardinality stay bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix_length(a: Sequence[int], b: Sequence[int], chunk: int = 4096) -> int:
    """Length of the longest common prefix: chunked slice comparisons in C, then item by item."""
    limit = min(len(a), len(b))
    for start in range(0, limit, chunk):
        end = min(start + chunk, limit)
        if a[start:end] != b[start:end]:
            return next(i for i in range(start, end) if a[i] != b[i])
    return limit


@dataclass(slots=True)
class SessionStats:
    session: str
    api: str
    backend: str = ""
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    extended_tokens: int = 0
    """Prompt tokens (of turns after the first) that extend the previous turn."""
    compared_tokens: int = 0
    """Prompt tokens of turns after the first."""
    last_ttft_s: float | None = None
    last_tokens: list[int] = field(default_factory=list, repr=False)
    """Previous prompt + generated ids, to measure the next turn against."""
    last_text: str | None = field(default=None, repr=False)
    """The previous turn as its client will resend it (prompt text + plain reply), if it can."""
    last_ids: list[int] = field(default_factory=list, repr=False)
    """The ids behind `last_text`: the previous prompt and the generated tokens."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def append_ratio(self) -> float | None:
        return self.extended_tokens / self.compared_tokens if self.compared_tokens else None

    def as_json(self) -> dict[str, object]:
        return {
            "session": self.session,
            "api": self.api,
            "backend": self.backend,
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "hit_rate": self.hit_rate,
            "append_ratio": self.append_ratio,
            "last_ttft_s": self.last_ttft_s,
        }


class SessionRegistry:
    def __init__(self, max_sessions: int = 1000) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, SessionStats] = OrderedDict()

    def get(self, session: str) -> SessionStats | None:
        return self._sessions.get(session)

    def recent(self) -> list[SessionStats]:
        """Most recently used first."""
        return list(reversed(self._sessions.values()))

    def append_ratio_of(self, session: str, prompt: Sequence[int]) -> float | None:
        """How much of `prompt` extends the session's previous turn (None for a first turn)."""
        stats = self._sessions.get(session)
        if stats is None or not stats.last_tokens or not prompt:
            return None
        return common_prefix_length(stats.last_tokens, prompt) / len(prompt)

    def record(
        self,
        session: str,
        api: str,
        backend: str,
        prompt: Sequence[int],
        output: Sequence[int],
        cached_tokens: int,
        ttft_s: float | None,
    ) -> SessionStats:
        """Account one finished turn. Mutates the session's entry (creating it, evicting the LRU one)."""
        stats = self._sessions.pop(session, None) or SessionStats(session, api)
        if stats.last_tokens:
            stats.extended_tokens += common_prefix_length(stats.last_tokens, prompt)
            stats.compared_tokens += len(prompt)
        stats.api, stats.backend = api, backend
        stats.turns += 1
        stats.prompt_tokens += len(prompt)
        stats.cached_tokens += cached_tokens
        stats.completion_tokens += len(output)
        stats.last_ttft_s = ttft_s
        stats.last_tokens = [*prompt, *output]
        self._sessions[session] = stats
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return stats

"""Session-to-backend placement: a session stays where its cache is; new sessions go where load is least.

`Placement.choose(session)` returns the session's backend while that backend is healthy; otherwise (a
new session, or its backend marked down) the healthy backend with the fewest requests in flight, ties
broken by the order backends were configured in. `mark_down` / `mark_up` come from health checks and
from failed requests; `started` / `finished` keep the in-flight counts. The policy is this small class
behind `choose`, so cache-aware placement can replace it without touching the gateway.
"""

from __future__ import annotations

from collections import OrderedDict


class NoBackendAvailable(RuntimeError):
    """Every backend is marked down."""


class Placement:
    def __init__(self, backends: list[str], max_sessions: int = 100_000) -> None:
        if not backends:
            raise ValueError("at least one backend is needed")
        self.backends = list(dict.fromkeys(backends))
        self.healthy = dict.fromkeys(self.backends, True)
        self.in_flight = dict.fromkeys(self.backends, 0)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def choose(self, session: str, exclude: frozenset[str] = frozenset()) -> str:
        """The backend for `session` (sticky); records the choice. Raises NoBackendAvailable."""
        current = self._sessions.get(session)
        if current is not None and self.healthy[current] and current not in exclude:
            self._sessions.move_to_end(session)
            return current
        candidates = [b for b in self.backends if self.healthy[b] and b not in exclude]
        if not candidates:
            raise NoBackendAvailable("no healthy backend")
        chosen = min(candidates, key=lambda b: (self.in_flight[b], self.backends.index(b)))
        self._sessions[session] = chosen
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return chosen

    def backend_of(self, session: str) -> str | None:
        return self._sessions.get(session)

    def started(self, backend: str) -> None:
        self.in_flight[backend] += 1

    def finished(self, backend: str) -> None:
        self.in_flight[backend] -= 1

    def mark_down(self, backend: str) -> None:
        self.healthy[backend] = False

    def mark_up(self, backend: str) -> None:
        self.healthy[backend] = True

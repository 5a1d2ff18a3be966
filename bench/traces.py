"""Recorded Claude Code traces as replayable sessions, with deterministic synthetic token ids.

The traces (`../shared/traces/claude-code`, format in its README) are gzipped JSON conversations whose
requests carry sizes, timings and the input as run-length encoded 64-token block ids, but no text.
`load_trace` / `load_traces` turn them into frozen `Session`s; `TokenSynthesizer` turns a request into
token ids that reproduce the trace's prefix sharing. Standard library only.

Sessions. A file is one top-level session (id = file name without `.json.gz`). Each `subagent` entry in
its `requests` is a nested conversation that ran concurrently; it is removed from the parent's list and
returned as a separate session `"<parent id>/<agent_id>"` (recursively), with `parent_id` set and
`start_offset_s` = the time it started, in seconds since the top-level conversation started (for a
direct subagent, the `t` of its entry in the parent's `requests`). `load_trace` returns the top-level
session first, then its subagents depth-first in trace order. A subagent has no `block_size` of its own
and uses its parent's.

Optional fields: `think_time` is absent from 89 streaming requests (read as 0.0); `api_time` is absent
from 3,278 streaming requests and `ttft` from all but 3,399 requests (both read as None).

Errors. Anything wrong with a file's content raises `TraceFormatError` (a `ValueError`) whose message
starts with the file name and the JSON path, e.g. `x.json.gz: requests[3].hash_ids[1]: ...`: not gzip,
not JSON, a missing field, a wrong type, a negative count or time, malformed `hash_ids` pairs, or more
block ids than `in` tokens fill. A directory without `*.json.gz` files raises it too. A missing file
raises `FileNotFoundError` as usual. The dataclasses validate their values in `__post_init__`
(`ValueError`), so hand-built sessions obey the same rules.

Token synthesis. A request's prompt of `in` tokens is laid out as (B = block_size, P = shared prefix
`min(tool_tokens + system_tokens, in)`, nb = number of block ids):

    position  0            P                                   B*nb        in
              | shared     | block content: block k covers       | tail      |
              | stream     | [B*k, B*k + B), token j of block id | (request- |
              |            | b = f(seed, trace, b, j)            |  unique)  |

- [0, P): one global stream, a pure function of (seed, position): every session starts with the same
  tokens, and two sessions share the first min of their shared prefixes.
- [P, min(in, B*nb)): per-block content, a pure function of (seed, trace id, block id, offset). The key
  is the top-level trace id (`Session.trace_id`), not the session id, because hash ids are scoped to the
  whole file (`hash_id_scope: local`): sibling subagents reuse the parent conversation's id space, and in
  all 12 files with two or more subagents, siblings share their first 138 to 281 blocks (their prompt, a
  few hundred to 9K tokens beyond tools + system), which this keying preserves. For top-level sessions,
  trace id == session id.
- [max(P, B*nb), in): a stream unique to (seed, session id, request index), indexed from B*nb. In these
  traces it is at most 63 tokens: the partial last block, which `hash_ids` leaves out in 98.6% of
  requests.
So two requests of a session share a token prefix exactly as far as their block ids agree (and at least
the shared stream). Across sessions of one trace this also holds as long as sessions whose block ids
agree past the smaller P have equal P, which is true of all 600 traces.

Speed. Token words come from `hashlib.shake_128` (an extendable-output hash, so a stream of any length
is a prefix of any longer one), unpacked as little-endian uint32 and reduced modulo `vocab_size`.
Measured on the dev machine (2 cores) for a 100K-token prompt: ~27 ms with no block cached (one shake
call per 64-token block), ~4 ms with all cached; a splitmix64 mix per token in pure Python takes ~65 ms.
Block contents stay in a bounded LRU (`max_cached_blocks`, ~2.4 KB per block, 16,384 blocks ~40 MB by
default), so the requests of a session, which extend each other, mostly hit it.

Memory. The 600 traces hold 80.9M block ids. The loader expands them into tuples that share one int
object per id value (`_IdPool`): `load_traces` of all 600 peaks at 0.66 GB RSS and takes ~4 s, where a
fresh int per entry would need ~2.9 GB.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import statistics
import struct
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import NamedTuple

TRACE_SUFFIX = ".json.gz"
_MAX_POOLED_ID = 1 << 20  # ids above this are expanded without sharing (never seen: max is 42,180)


class TraceFormatError(ValueError):
    """A trace file that is not gzip, not JSON or not in the trace format; the message names the file."""


# --------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One model call of a session, as recorded."""

    arrival_offset_s: float
    """`t`: seconds since the session started (for a subagent, add `Session.start_offset_s`)."""
    kind: str
    """`type`: "s" streaming or "n" non-streaming."""
    model: str
    input_tokens: int
    """`in`: exact prompt length."""
    output_tokens: int
    """`out`."""
    block_ids: tuple[int, ...]
    """`hash_ids` expanded: block k covers prompt positions [k * block_size, (k + 1) * block_size)."""
    think_time_s: float
    """Client-side delay before this request (tool execution plus agent time); 0.0 when not recorded."""
    stop: str
    """"tool_use", "end_turn" or ""."""
    api_time_s: float | None = None
    """Server time as recorded; None when not recorded."""
    ttft_s: float | None = None
    """Time to first token; recorded for some streaming requests only."""

    def __post_init__(self) -> None:
        if self.kind not in ("s", "n"):
            raise ValueError(f"kind (`type`) must be 's' or 'n', got {self.kind!r}")
        for name in ("input_tokens", "output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("arrival_offset_s", "think_time_s", "api_time_s", "ttft_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite time >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation (a trace file, or a subagent inside one) whose requests run one after another."""

    session_id: str
    """File name without `.json.gz`, e.g. "trace_0001"; a subagent appends "/<agent_id>"."""
    tool_tokens: int
    """Size of the tool definitions at the start of every request."""
    system_tokens: int
    """Size of the system prompt, after the tool definitions."""
    requests: tuple[TraceRequest, ...]
    """In time order, without subagent entries."""
    parent_id: str | None = None
    """Session id of the parent; None for a top-level session."""
    start_offset_s: float = 0.0
    """When the session started, in seconds since the top-level conversation started."""
    block_size: int = 64
    """Tokens per hash block."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("tool_tokens", "system_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.start_offset_s) and self.start_offset_s >= 0):
            raise ValueError(f"start_offset_s must be a finite time >= 0, got {self.start_offset_s}")
        for index, request in enumerate(self.requests):
            max_blocks = -(-request.input_tokens // self.block_size)
            if len(request.block_ids) > max_blocks:
                raise ValueError(
                    f"requests[{index}]: {len(request.block_ids)} block ids of {self.block_size} tokens "
                    f"are more than input_tokens={request.input_tokens} fill"
                )

    @property
    def shared_prefix_tokens(self) -> int:
        """Tokens at the start of every request that all sessions share (tools plus system prompt)."""
        return self.tool_tokens + self.system_tokens

    @property
    def trace_id(self) -> str:
        """The top-level session id: the scope in which block ids are comparable."""
        return self.session_id.partition("/")[0]


# --------------------------------------------------------------------------------------------------
# Loading


class _Where(NamedTuple):
    """A location in a trace file, for error messages: file name plus JSON path."""

    file: str
    path: str = ""

    def at(self, key: str | int) -> _Where:
        if isinstance(key, int):
            return _Where(self.file, f"{self.path}[{key}]")
        return _Where(self.file, f"{self.path}.{key}" if self.path else key)

    def error(self, message: str) -> TraceFormatError:
        return TraceFormatError(f"{self.file}: {self.path or 'top level'}: {message}")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _get(obj: Mapping[str, object], key: str, where: _Where) -> object:
    if key not in obj:
        raise where.error(f"missing field {key!r}")
    return obj[key]


def _as_object(value: object, where: _Where) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise where.error(f"expected a JSON object, got {_type_name(value)}")
    return value


def _as_list(value: object, where: _Where) -> list[object]:
    if not isinstance(value, list):
        raise where.error(f"expected a list, got {_type_name(value)}")
    return value


def _get_int(obj: Mapping[str, object], key: str, where: _Where) -> int:
    value = _get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.at(key).error(f"expected an integer, got {_type_name(value)}")
    return value


def _get_str(obj: Mapping[str, object], key: str, where: _Where) -> str:
    value = _get(obj, key, where)
    if not isinstance(value, str):
        raise where.at(key).error(f"expected a string, got {_type_name(value)}")
    return value


def _get_time(obj: Mapping[str, object], key: str, where: _Where) -> float:
    value = _get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise where.at(key).error(f"expected a number, got {_type_name(value)}")
    return float(value)


def _get_optional_time(obj: Mapping[str, object], key: str, where: _Where) -> float | None:
    return _get_time(obj, key, where) if key in obj else None


def _pair(run: object) -> tuple[int, int] | None:
    """`[first_id, count]` as a tuple, or None if malformed. (`type(x) is int` also rejects bools.)"""
    if type(run) is not list or len(run) != 2 or type(run[0]) is not int or type(run[1]) is not int:
        return None
    return (run[0], run[1]) if run[0] >= 0 and run[1] >= 1 else None


class _IdPool:
    """Expands `hash_ids` so that equal ids share one int object (see "Memory" in the module docstring)."""

    def __init__(self) -> None:
        self._ints: tuple[int, ...] = ()

    def expand(self, runs: object, where: _Where) -> tuple[int, ...]:
        pairs: list[tuple[int, int]] = []
        for index, run in enumerate(_as_list(runs, where)):
            pair = _pair(run)
            if pair is None:
                message = f"expected [first_id, count] with first_id >= 0 and count >= 1, got {run!r}"
                raise where.at(index).error(message)
            pairs.append(pair)
        end = max((first + count for first, count in pairs), default=0)
        if end > _MAX_POOLED_ID:
            return tuple(chain.from_iterable(range(first, first + count) for first, count in pairs))
        if end > len(self._ints):  # grow geometrically: ids rise a few blocks per request
            self._ints += tuple(range(len(self._ints), max(end, 2 * len(self._ints))))
        ints = self._ints
        if len(pairs) == 1:  # 19% of requests; a tuple slice copies once
            first, count = pairs[0]
            return ints[first : first + count]
        ids: list[int] = []
        for first, count in pairs:
            ids += ints[first : first + count]
        return tuple(ids)


def expand_hash_ids(runs: object) -> tuple[int, ...]:
    """Expand run-length `[[first_id, count], ...]` into block ids; `TraceFormatError` if malformed."""
    return _IdPool().expand(runs, _Where("<hash_ids>"))


def _parse_request(obj: Mapping[str, object], pool: _IdPool, where: _Where) -> TraceRequest:
    try:
        return TraceRequest(
            arrival_offset_s=_get_time(obj, "t", where),
            kind=_get_str(obj, "type", where),
            model=_get_str(obj, "model", where),
            input_tokens=_get_int(obj, "in", where),
            output_tokens=_get_int(obj, "out", where),
            block_ids=pool.expand(_get(obj, "hash_ids", where), where.at("hash_ids")),
            think_time_s=_get_optional_time(obj, "think_time", where) or 0.0,
            stop=_get_str(obj, "stop", where),
            api_time_s=_get_optional_time(obj, "api_time", where),
            ttft_s=_get_optional_time(obj, "ttft", where),
        )
    except TraceFormatError:
        raise
    except ValueError as exc:
        raise where.error(str(exc)) from exc


def _parse_session(
    obj: Mapping[str, object],
    ids: tuple[str, str | None],
    start_offset_s: float,
    block_size: int,
    pool: _IdPool,
    where: _Where,
) -> list[Session]:
    """Parse one conversation and, after it, its subagents (depth-first). `ids` is (session, parent)."""
    session_id, parent_id = ids
    requests: list[TraceRequest] = []
    children: list[tuple[Mapping[str, object], _Where]] = []
    requests_where = where.at("requests")
    for index, item in enumerate(_as_list(_get(obj, "requests", where), requests_where)):
        item_where = requests_where.at(index)
        entry = _as_object(item, item_where)
        if entry.get("type") == "subagent":
            children.append((entry, item_where))
        else:
            requests.append(_parse_request(entry, pool, item_where))
    try:
        session = Session(
            session_id=session_id,
            tool_tokens=_get_int(obj, "tool_tokens", where),
            system_tokens=_get_int(obj, "system_tokens", where),
            requests=tuple(requests),
            parent_id=parent_id,
            start_offset_s=start_offset_s,
            block_size=block_size,
        )
    except TraceFormatError:
        raise
    except ValueError as exc:
        raise where.error(str(exc)) from exc
    sessions = [session]
    for child, child_where in children:
        child_id = f"{session_id}/{_get_str(child, 'agent_id', child_where)}"
        offset = start_offset_s + _get_time(child, "t", child_where)
        sessions += _parse_session(child, (child_id, session_id), offset, block_size, pool, child_where)
    return sessions


def _read_json(path: Path) -> object:
    data = path.read_bytes()
    try:
        text = gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceFormatError(f"{path.name}: not a gzip file ({exc})") from exc
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise TraceFormatError(f"{path.name}: not JSON ({exc})") from exc


def _session_id(path: Path) -> str:
    return path.name.removesuffix(TRACE_SUFFIX) if path.name.endswith(TRACE_SUFFIX) else path.stem


def _load(path: Path, pool: _IdPool) -> list[Session]:
    where = _Where(path.name)
    doc = _as_object(_read_json(path), where)
    block_size = _get_int(doc, "block_size", where)
    if block_size <= 0:
        raise where.at("block_size").error(f"must be positive, got {block_size}")
    return _parse_session(doc, (_session_id(path), None), 0.0, block_size, pool, where)


def load_trace(path: str | Path) -> list[Session]:
    """Load one trace file: its top-level session first, then its subagents (depth-first, trace order)."""
    return _load(Path(path), _IdPool())


def load_traces(directory: str | Path, limit: int | None = None, min_requests: int = 1) -> list[Session]:
    """Load the `*.json.gz` traces of `directory` in file-name order.

    `limit` caps the number of files (top-level traces) read; sessions (subagents included) with fewer
    than `min_requests` requests are dropped. Raises `TraceFormatError` if the directory has no traces.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    directory = Path(directory)
    paths = sorted(directory.glob(f"*{TRACE_SUFFIX}"))
    if not paths:
        raise TraceFormatError(f"{directory}: no trace files (*{TRACE_SUFFIX})")
    pool = _IdPool()
    sessions = [session for path in paths[:limit] for session in _load(path, pool)]
    return [session for session in sessions if len(session.requests) >= min_requests]


# --------------------------------------------------------------------------------------------------
# Token synthesis


class TokenSynthesizer:
    """Deterministic token ids for trace requests (layout in the module docstring).

    Every token is a pure function of `seed` and its position in the layout, so two instances with the
    same seed and vocab size agree. Not thread-safe (the block LRU is a plain dict).
    """

    def __init__(self, seed: int = 0, vocab_size: int = 32000, *, max_cached_blocks: int = 16384) -> None:
        if not 1 <= vocab_size <= 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
        if max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks must be >= 0, got {max_cached_blocks}")
        self.seed = seed
        self.vocab_size = vocab_size
        self.max_cached_blocks = max_cached_blocks
        self._shared: list[int] = []
        self._blocks: OrderedDict[tuple[str, int, int], tuple[int, ...]] = OrderedDict()

    def prompt_tokens(self, session: Session, request_index: int) -> list[int]:
        """The `input_tokens` token ids of `session.requests[request_index]`, each in [0, vocab_size)."""
        request = session.requests[request_index]
        num_tokens, block_size = request.input_tokens, session.block_size
        num_shared = min(session.shared_prefix_tokens, num_tokens)
        tokens = self._shared_prefix(num_shared)
        tail_start = block_size * len(request.block_ids)
        blocks_end = min(num_tokens, tail_start)
        for k in range(num_shared // block_size, -(-blocks_end // block_size)):
            content = self._block(session.trace_id, request.block_ids[k], block_size)
            lo, hi = max(num_shared - k * block_size, 0), min(blocks_end - k * block_size, block_size)
            tokens.extend(content if (lo, hi) == (0, block_size) else content[lo:hi])
        if num_tokens > max(num_shared, tail_start):
            tail = self._stream(("request", session.session_id, request_index), num_tokens - tail_start)
            tokens.extend(tail[max(num_shared - tail_start, 0) :])
        return tokens

    def unique_tokens(self, key: str, num_tokens: int) -> list[int]:
        """`num_tokens` ids that depend only on (seed, key), e.g. a synthetic reply; a longer call with
        the same key extends a shorter one."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return self._stream(("unique", key), num_tokens)

    def _stream(self, parts: tuple[str | int, ...], num_tokens: int) -> list[int]:
        """`num_tokens` ids from the stream named by `parts` (a longer stream extends a shorter one)."""
        key = "\x00".join(str(part) for part in (self.seed, *parts)).encode()
        words = struct.unpack(f"<{num_tokens}I", hashlib.shake_128(key).digest(4 * num_tokens))
        vocab_size = self.vocab_size
        return [word % vocab_size for word in words]

    def _shared_prefix(self, num_tokens: int) -> list[int]:
        if num_tokens > len(self._shared):
            self._shared = self._stream(("shared",), max(num_tokens, 2 * len(self._shared)))
        return self._shared[:num_tokens]

    def _block(self, trace_id: str, block_id: int, block_size: int) -> tuple[int, ...]:
        key = (trace_id, block_id, block_size)
        content = self._blocks.get(key)
        if content is not None:
            self._blocks.move_to_end(key)
            return content
        content = tuple(self._stream(("block", trace_id, block_id), block_size))
        self._blocks[key] = content
        if len(self._blocks) > self.max_cached_blocks:
            self._blocks.popitem(last=False)
        return content


# --------------------------------------------------------------------------------------------------
# Summary


def _extends(previous: TraceRequest, current: TraceRequest, num_ignored_blocks: int = 0) -> bool:
    """True if `current`'s block ids start with all of `previous`'s but its last `num_ignored_blocks`."""
    num_blocks = max(len(previous.block_ids) - num_ignored_blocks, 0)
    return current.block_ids[:num_blocks] == previous.block_ids[:num_blocks]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def describe(sessions: Sequence[Session]) -> dict[str, float]:
    """Headline numbers of a set of sessions: counts, medians, and shares in [0, 1] (0 when undefined).

    "Following" requests are those with a predecessor in their session; one "extends" the previous if
    its block ids start with all of the previous request's. The traces' README counts 97% extending: that
    matches ignoring the previous request's last block (93% extend it fully).
    """
    inputs = [request.input_tokens for session in sessions for request in session.requests]
    followers = [(s.requests[i - 1], s.requests[i]) for s in sessions for i in range(1, len(s.requests))]
    return {
        "sessions": len(sessions),
        "subagent_sessions": sum(session.parent_id is not None for session in sessions),
        "requests": len(inputs),
        "median_input_tokens": _median(inputs),
        "share_input_over_64k": _share([n > 64_000 for n in inputs]),
        "share_extending_previous": _share([_extends(prev, cur) for prev, cur in followers]),
        "share_extending_previous_but_last_block": _share(
            [_extends(prev, cur, 1) for prev, cur in followers]
        ),
        "median_think_time_s": _median([cur.think_time_s for _, cur in followers]),
    }

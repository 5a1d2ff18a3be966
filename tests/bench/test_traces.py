"""Tests for the trace loader and token synthesizer (bench/traces.py)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from bench.traces import (
    Session,
    TokenSynthesizer,
    TraceFormatError,
    TraceRequest,
    describe,
    expand_hash_ids,
    load_trace,
    load_traces,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "claude-code"
requires_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real traces not found at {TRACES}")


# --------------------------------------------------------------------------------------------------
# Builders


def _request(**overrides: object) -> dict[str, object]:
    """One valid trace request (JSON form): 200 tokens, blocks 1-3 (192 tokens) plus an 8-token tail."""
    request: dict[str, object] = {"t": 0.0, "type": "n", "model": "m", "in": 200, "out": 10}
    request |= {"hash_ids": [[1, 3]], "stop": "tool_use", "think_time": 0.0, "api_time": 1.0}
    return request | overrides


def _doc(requests: object, **overrides: object) -> dict[str, object]:
    doc: dict[str, object] = {"id": "x", "models": ["m"], "block_size": 64, "hash_id_scope": "local"}
    doc |= {"tool_tokens": 30, "system_tokens": 20, "requests": requests, "totals": {}}
    return doc | overrides


def _subagent(agent_id: str, t: float, requests: list[object]) -> dict[str, object]:
    subagent: dict[str, object] = {"t": t, "type": "subagent", "agent_id": agent_id, "requests": requests}
    return subagent | {"subagent_type": "Explore", "tool_tokens": 5, "system_tokens": 5}


def _write(path: Path, doc: object) -> Path:
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def _session(block_ids: list[tuple[int, ...]], shared: int = 0, session_id: str = "s") -> Session:
    """A hand-built session whose requests fill their blocks exactly (64 tokens each)."""
    requests = tuple(TraceRequest(0.0, "n", "m", 64 * len(ids), 1, ids, 0.0, "tool_use") for ids in block_ids)
    return Session(session_id, tool_tokens=shared, system_tokens=0, requests=requests)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def trace_0001() -> Session:
    return load_trace(TRACES / "trace_0001.json.gz")[0]


# --------------------------------------------------------------------------------------------------
# Run-length expansion


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        pytest.param([], (), id="empty"),
        pytest.param([[1, 3]], (1, 2, 3), id="one-run"),
        pytest.param([[1, 3], [10, 2]], (1, 2, 3, 10, 11), id="two-runs"),
        pytest.param([[0, 1], [0, 1]], (0, 0), id="repeated-id"),
    ],
)
def test_expand_hash_ids(runs: list[list[int]], expected: tuple[int, ...]) -> None:
    assert expand_hash_ids(runs) == expected


def test_expand_hash_ids_beyond_pool() -> None:
    """Ids too large to pool are expanded all the same."""
    assert expand_hash_ids([[2**40, 2]]) == (2**40, 2**40 + 1)


@pytest.mark.parametrize(
    "runs",
    [
        pytest.param("1,3", id="not-a-list"),
        pytest.param([[1]], id="single"),
        pytest.param([[1, 2, 3]], id="triple"),
        pytest.param([[1, 0]], id="zero-count"),
        pytest.param([[-1, 2]], id="negative-first"),
        pytest.param([[1, True]], id="bool"),
        pytest.param([["1", 2]], id="string"),
        pytest.param([[1.0, 2]], id="float"),
        pytest.param([5], id="bare-int"),
    ],
)
def test_expand_hash_ids_rejects_malformed(runs: object) -> None:
    with pytest.raises(TraceFormatError):
        expand_hash_ids(runs)


# --------------------------------------------------------------------------------------------------
# Loading real traces


@requires_traces
def test_load_trace_reads_the_fields(trace_0001: Session) -> None:
    """trace_0001 has no subagents; request 0 is `{"t": 0.0, "in": 71175, "hash_ids": [[1, 1112]], ...}`."""
    assert (trace_0001.session_id, trace_0001.parent_id) == ("trace_0001", None)
    assert trace_0001.start_offset_s == 0.0
    assert (trace_0001.tool_tokens, trace_0001.system_tokens, trace_0001.block_size) == (12974, 4243, 64)
    assert trace_0001.shared_prefix_tokens == 17217
    assert len(trace_0001.requests) == 41
    first, second = trace_0001.requests[:2]
    assert first == TraceRequest(
        arrival_offset_s=0.0,
        kind="n",
        model="claude-opus-4-5-20251101",
        input_tokens=71175,
        output_tokens=169,
        block_ids=tuple(range(1, 1113)),
        think_time_s=0.0,
        stop="tool_use",
        api_time_s=7.34,
        ttft_s=None,
    )
    assert (second.arrival_offset_s, second.think_time_s) == (19.0, 12.0)
    assert second.block_ids == tuple(range(1, 1137))


@requires_traces
def test_subagents_are_flattened() -> None:
    """trace_0003 has two `type: "subagent"` entries (agent_001 at t=134.227, agent_002 at t=3054.335)."""
    raw = json.loads(gzip.decompress((TRACES / "trace_0003.json.gz").read_bytes()))
    parent, first, second = load_trace(TRACES / "trace_0003.json.gz")
    assert [s.session_id for s in (parent, first, second)] == [
        "trace_0003",
        "trace_0003/agent_001",
        "trace_0003/agent_002",
    ]
    assert [s.parent_id for s in (parent, first, second)] == [None, "trace_0003", "trace_0003"]
    assert [s.start_offset_s for s in (parent, first, second)] == [0.0, 134.227, 3054.335]
    assert len(parent.requests) == len(raw["requests"]) - 2
    assert [len(first.requests), len(second.requests)] == [10, 4]
    assert (first.tool_tokens, first.system_tokens, first.block_size) == (8306, 735, 64)
    assert first.requests[0].block_ids[:2] == (36622, 36623)
    assert {s.trace_id for s in (parent, first, second)} == {"trace_0003"}


@requires_traces
def test_load_traces_limit_and_min_requests() -> None:
    """`limit` counts files; `min_requests` drops short sessions (trace_0003/agent_002 has 4 requests)."""
    ids = [s.session_id for s in load_traces(TRACES, limit=3)]
    assert ids == ["trace_0001", "trace_0002", "trace_0003", "trace_0003/agent_001", "trace_0003/agent_002"]
    ids = [s.session_id for s in load_traces(TRACES, limit=3, min_requests=5)]
    assert "trace_0003/agent_002" not in ids
    assert "trace_0003/agent_001" in ids
    assert load_traces(TRACES, limit=0) == []


@requires_traces
@pytest.mark.slow
def test_describe_all_traces_matches_readme() -> None:
    """The traces' README: median input 104K, 76% above 64K, 97% extend the previous, median think 10 s."""
    summary = describe(load_traces(TRACES))
    assert (summary["sessions"], summary["subagent_sessions"], summary["requests"]) == (656, 56, 41765)
    assert 100_000 < summary["median_input_tokens"] < 108_000
    assert summary["share_input_over_64k"] == pytest.approx(0.76, abs=0.01)
    assert summary["share_extending_previous_but_last_block"] == pytest.approx(0.97, abs=0.01)
    assert summary["share_extending_previous"] < summary["share_extending_previous_but_last_block"]
    assert summary["median_think_time_s"] == 10.0


# --------------------------------------------------------------------------------------------------
# Loading synthetic and broken files


def test_nested_subagents_are_flattened_depth_first(tmp_path: Path) -> None:
    inner = _subagent("b", 2.0, [_request(t=0.5)])
    outer = _subagent("a", 10.0, [_request(), inner, _request(t=3.0)])
    sibling = _subagent("c", 20.0, [])
    path = _write(tmp_path / "conv.json.gz", _doc([_request(), outer, _request(t=30.0), sibling]))
    sessions = load_trace(path)
    assert [(s.session_id, s.parent_id, s.start_offset_s, len(s.requests)) for s in sessions] == [
        ("conv", None, 0.0, 2),
        ("conv/a", "conv", 10.0, 2),
        ("conv/a/b", "conv/a", 12.0, 1),
        ("conv/c", "conv", 20.0, 0),
    ]
    assert [s.session_id for s in load_traces(tmp_path)] == ["conv", "conv/a", "conv/a/b"]


def test_optional_fields_default(tmp_path: Path) -> None:
    request = _request(type="s", ttft=0.5)
    del request["think_time"], request["api_time"]
    (loaded,) = load_trace(_write(tmp_path / "opt.json.gz", _doc([request]))).pop().requests
    assert (loaded.kind, loaded.think_time_s, loaded.api_time_s, loaded.ttft_s) == ("s", 0.0, None, 0.5)


def _without(mapping: dict[str, object], key: str) -> dict[str, object]:
    return {k: v for k, v in mapping.items() if k != key}


BAD_DOCS = [
    pytest.param([1, 2], "top level: expected a JSON object", id="not-an-object"),
    pytest.param(_without(_doc([]), "requests"), "missing field 'requests'", id="missing-requests"),
    pytest.param(_doc("x"), "requests: expected a list", id="requests-not-list"),
    pytest.param(_doc([_request(hash_ids=[[1, 3], [5]])]), "requests[0].hash_ids[1]", id="hash-ids-pair"),
    pytest.param(_doc([_request(hash_ids=[[1, -3]])]), "requests[0].hash_ids[0]", id="hash-ids-count"),
    pytest.param(_doc([_request(hash_ids=7)]), "requests[0].hash_ids: expected a list", id="hash-ids-int"),
    pytest.param(_doc([_request(**{"in": -5})]), "input_tokens must be >= 0", id="negative-in"),
    pytest.param(_doc([_request(out=-1)]), "output_tokens must be >= 0", id="negative-out"),
    pytest.param(_doc([_request(**{"in": "200"})]), "requests[0].in: expected an integer", id="in-string"),
    pytest.param(_doc([_request(t=None)]), "requests[0].t: expected a number, got null", id="t-null"),
    pytest.param(_doc([_request(think_time=-1.0)]), "think_time_s must be a finite", id="negative-think"),
    pytest.param(_doc([_request(type="x")]), "kind (`type`) must be", id="unknown-type"),
    pytest.param(_doc([_without(_request(), "model")]), "missing field 'model'", id="missing-model"),
    pytest.param(_doc([_request(**{"in": 100})]), "3 block ids of 64 tokens", id="blocks-beyond-in"),
    pytest.param(_doc([_request()], block_size=0), "block_size: must be positive", id="block-size-zero"),
    pytest.param(_doc([_request()], tool_tokens=-1), "tool_tokens must be >= 0", id="negative-tools"),
    pytest.param(_doc(["x"]), "requests[0]: expected a JSON object", id="request-not-object"),
    pytest.param(
        _doc([_without(_subagent("a", 1.0, []), "agent_id")]),
        "requests[0]: missing field 'agent_id'",
        id="subagent-without-id",
    ),
    pytest.param(
        _doc([_subagent("a", 1.0, [_request(out=1.5)])]),
        "requests[0].requests[0].out: expected an integer",
        id="bad-request-in-subagent",
    ),
]


@pytest.mark.parametrize(("doc", "message"), BAD_DOCS)
def test_bad_content_raises_naming_file_and_field(tmp_path: Path, doc: object, message: str) -> None:
    path = _write(tmp_path / "bad.json.gz", doc)
    with pytest.raises(TraceFormatError, match=r"^bad\.json\.gz: .*" + re.escape(message)):
        load_trace(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b'{"requests": []}', "not a gzip file", id="plain-json"),
        pytest.param(gzip.compress(b"{" * 10)[:-6], "not a gzip file", id="truncated-gzip"),
        pytest.param(gzip.compress(b'{"requests": ['), "not JSON", id="invalid-json"),
        pytest.param(gzip.compress(b"\xff\xfe"), "not JSON", id="not-utf8"),
    ],
)
def test_undecodable_file_raises_naming_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "broken.json.gz"
    path.write_bytes(data)
    with pytest.raises(TraceFormatError, match=r"^broken\.json\.gz: " + message):
        load_trace(path)


def test_load_traces_propagates_bad_files(tmp_path: Path) -> None:
    _write(tmp_path / "a.json.gz", _doc([_request()]))
    (tmp_path / "b.json.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceFormatError, match=r"^b\.json\.gz"):
        load_traces(tmp_path)
    assert [s.session_id for s in load_traces(tmp_path, limit=1)] == ["a"]


def test_load_traces_on_directory_without_traces_raises(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no traces here")
    with pytest.raises(TraceFormatError, match="no trace files"):
        load_traces(tmp_path)


def test_dataclasses_validate() -> None:
    with pytest.raises(ValueError, match="input_tokens"):
        TraceRequest(0.0, "n", "m", -1, 0, (), 0.0, "")
    with pytest.raises(ValueError, match="2 block ids"):
        Session("s", 0, 0, (TraceRequest(0.0, "n", "m", 64, 0, (1, 2), 0.0, ""),))
    with pytest.raises(ValueError, match="block_size"):
        Session("s", 0, 0, (), block_size=0)


# --------------------------------------------------------------------------------------------------
# Token synthesis


@requires_traces
def test_shared_prefix_is_identical_across_sessions(trace_0001: Session) -> None:
    """trace_0001 (17,217 shared tokens) and trace_0003's first subagent (9,041) share 9,041 tokens."""
    subagent = load_trace(TRACES / "trace_0003.json.gz")[1]
    synthesizer = TokenSynthesizer()
    a, b = synthesizer.prompt_tokens(trace_0001, 0), synthesizer.prompt_tokens(subagent, 0)
    assert subagent.shared_prefix_tokens == 9041
    assert _common_prefix_len(a, b) == 9041


@requires_traces
def test_extending_request_shares_its_block_prefix(trace_0001: Session) -> None:
    """Request 1 (blocks 1-1136) extends request 0 (blocks 1-1112 plus a 7-token tail)."""
    synthesizer = TokenSynthesizer()
    first, second = synthesizer.prompt_tokens(trace_0001, 0), synthesizer.prompt_tokens(trace_0001, 1)
    assert _common_prefix_len(first, second) == 1112 * 64


@requires_traces
def test_diverging_request_diverges_at_the_first_differing_block(trace_0001: Session) -> None:
    """Requests 4 and 5 of trace_0001 agree on blocks 0-1522; 39 and 40 on 0-268 only (a compaction),
    which ends inside the shared prefix (17,217 tokens), so the tokens agree up to the shared prefix."""
    requests = trace_0001.requests
    assert requests[4].block_ids[:1523] == requests[5].block_ids[:1523] != requests[4].block_ids[:1524]
    assert requests[39].block_ids[269] != requests[40].block_ids[269]
    synthesizer = TokenSynthesizer()
    tokens = [synthesizer.prompt_tokens(trace_0001, i) for i in (4, 5, 39, 40)]
    assert _common_prefix_len(tokens[0], tokens[1]) == 1523 * 64
    assert _common_prefix_len(tokens[2], tokens[3]) == 17217


@pytest.mark.parametrize("shared", [0, 100, 160])
def test_mutation_diverges_at_the_right_block(shared: int) -> None:
    """Blocks (1, 2, 3, 4) against (1, 2, 9, 4): tokens agree up to block 2 (128) or the shared prefix."""
    session = _session([(1, 2, 3, 4), (1, 2, 9, 4)], shared=shared)
    synthesizer = TokenSynthesizer()
    a, b = synthesizer.prompt_tokens(session, 0), synthesizer.prompt_tokens(session, 1)
    assert _common_prefix_len(a, b) == max(128, shared)
    assert a[192:] == b[192:]  # block 4 again: the same content at the same place


def test_same_block_id_same_content_across_sessions_of_a_trace() -> None:
    """Block ids are scoped to the trace file, so sibling subagents sharing ids share tokens."""
    first, second = _session([(5, 6, 7)], session_id="t/a"), _session([(5, 6, 8)], session_id="t/b")
    other_trace = _session([(5, 6, 7)], session_id="u/a")
    synthesizer = TokenSynthesizer()
    a, b, c = (synthesizer.prompt_tokens(s, 0) for s in (first, second, other_trace))
    assert _common_prefix_len(a, b) == 128
    assert _common_prefix_len(a, c) == 0


def test_short_request_and_partial_last_block() -> None:
    """A prompt shorter than the shared prefix is all shared stream; a partial last block is cut."""
    request = TraceRequest(0.0, "n", "m", 100, 1, (1, 2), 0.0, "")
    partial = Session("p", 0, 0, (request,))
    short = Session("s", 500, 0, (request,))
    blockless = Session("b", 300, 0, (TraceRequest(0.0, "n", "m", 100, 1, (), 0.0, ""),))
    full = _session([(1, 2)], session_id="p")
    synthesizer = TokenSynthesizer()
    assert synthesizer.prompt_tokens(partial, 0) == synthesizer.prompt_tokens(full, 0)[:100]
    assert synthesizer.prompt_tokens(short, 0) == synthesizer.prompt_tokens(blockless, 0)


@requires_traces
def test_tokens_have_the_right_length_and_range(trace_0001: Session) -> None:
    synthesizer = TokenSynthesizer(vocab_size=1000)
    for index, request in enumerate(trace_0001.requests):
        tokens = synthesizer.prompt_tokens(trace_0001, index)
        assert len(tokens) == request.input_tokens
        assert min(tokens) >= 0 and max(tokens) < 1000


@requires_traces
def test_largest_request_of_a_trace(trace_0001: Session) -> None:
    """Request 40 of trace_0001 has 196,860 tokens (not timed here: ~60 ms cold on a dev machine)."""
    index = max(range(len(trace_0001.requests)), key=lambda i: trace_0001.requests[i].input_tokens)
    tokens = TokenSynthesizer().prompt_tokens(trace_0001, index)
    assert len(tokens) == trace_0001.requests[index].input_tokens == 196_860


@requires_traces
def test_same_seed_same_tokens_and_cache_size_does_not_matter(trace_0001: Session) -> None:
    """Same seed must produce identical tokens, whatever the LRU size; another seed differs."""
    a, b = TokenSynthesizer(seed=7), TokenSynthesizer(seed=7, max_cached_blocks=1)
    for index in (0, 1, 5, 40):
        assert a.prompt_tokens(trace_0001, index) == b.prompt_tokens(trace_0001, index)
    other = TokenSynthesizer(seed=8).prompt_tokens(trace_0001, 0)
    assert _common_prefix_len(a.prompt_tokens(trace_0001, 0), other) == 0


def test_unique_tokens() -> None:
    synthesizer = TokenSynthesizer(seed=3, vocab_size=50)
    reply = synthesizer.unique_tokens("trace_0001/0/out", 100)
    assert len(reply) == 100 and all(0 <= t < 50 for t in reply)
    assert TokenSynthesizer(seed=3, vocab_size=50).unique_tokens("trace_0001/0/out", 100) == reply
    assert synthesizer.unique_tokens("trace_0001/0/out", 40) == reply[:40]
    assert synthesizer.unique_tokens("trace_0001/1/out", 100) != reply
    assert synthesizer.unique_tokens("k", 0) == []
    with pytest.raises(ValueError, match="num_tokens"):
        synthesizer.unique_tokens("k", -1)


@pytest.mark.parametrize("kwargs", [{"vocab_size": 0}, {"vocab_size": 2**32 + 1}, {"max_cached_blocks": -1}])
def test_synthesizer_rejects_bad_config(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TokenSynthesizer(**kwargs)


# --------------------------------------------------------------------------------------------------
# Summary


def test_describe_counts_extensions() -> None:
    """Request 1 extends request 0; request 2 keeps all but its predecessor's last block."""
    parent = _session([(1, 2), (1, 2, 3), (1, 2, 4)])
    child = Session("s/a", 0, 0, parent.requests[:1], parent_id="s")
    assert describe([parent, child]) == {
        "sessions": 2,
        "subagent_sessions": 1,
        "requests": 4,
        "median_input_tokens": 160.0,
        "share_input_over_64k": 0.0,
        "share_extending_previous": 0.5,
        "share_extending_previous_but_last_block": 1.0,
        "median_think_time_s": 0.0,
    }
    assert describe([])["requests"] == 0


@requires_traces
def test_describe_real_trace(trace_0001: Session) -> None:
    summary = describe([trace_0001])
    assert (summary["sessions"], summary["requests"]) == (1, 41)
    assert 0.8 < summary["share_extending_previous"] < 1.0

"""OutputParser: narrative tests per format, then hypothesis properties over random texts and chunkings.

The central property: feeding any text in any chunking gives the same events (after merging adjacent
deltas) as feeding it at once, and everything emitted along the way is part of that final answer.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.conversation import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.output_parser import OutputParser, _coder_value

FORMATS = ("none", "hermes", "qwen3-coder")


def run(parser: OutputParser, chunks: Sequence[str]) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def parse(text: str, fmt: str = "hermes", chunk: int = 0, **kwargs: object) -> list[OutputEvent]:
    """Parses `text` fed whole (chunk=0) or in pieces of `chunk` characters; events merged."""
    parser = OutputParser(fmt, call_id_prefix="t", **kwargs)  # type: ignore[arg-type]
    chunks = [text[i : i + chunk] for i in range(0, len(text), chunk)] if chunk else [text]
    return merge(run(parser, chunks))


def merge(events: Sequence[OutputEvent]) -> list[OutputEvent]:
    """Joins adjacent deltas of one kind (and one call), so that chunkings compare equal."""
    out: list[OutputEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + e.text)
        elif isinstance(e, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + e.text)
        elif (
            isinstance(e, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and last.index == e.index
        ):
            out[-1] = ToolCallArgumentsDelta(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


def text_of(events: Sequence[OutputEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(events: Sequence[OutputEvent]) -> list[tuple[str, object]]:
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgumentsDelta):
            args[e.index] = args.get(e.index, "") + e.text
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


def call(index: int, name: str, args: str) -> list[OutputEvent]:
    return [
        ToolCallStart(index, f"call_{index}_t", name),
        ToolCallArgumentsDelta(index, args),
        ToolCallEnd(index),
    ]


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# --- hermes


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_text_then_one_call(chunk: int) -> None:
    """Text before a call loses its trailing whitespace; the arguments are the model's raw JSON text."""
    text = "Let me look.\n\n" + hermes("read", '{"path": "a.py"}')
    assert parse(text, chunk=chunk) == [TextDelta("Let me look.")] + call(0, "read", '{"path": "a.py"}')


def test_two_calls() -> None:
    text = hermes("read", '{"path": "a"}') + "\n" + hermes("read", '{"path": "b"}')
    assert parse(text, chunk=2) == call(0, "read", '{"path": "a"}') + call(1, "read", '{"path": "b"}')


def test_call_then_text() -> None:
    text = hermes("bash", '{"cmd": "ls"}') + "\n\nDone.\n"
    assert parse(text, chunk=1) == call(0, "bash", '{"cmd": "ls"}') + [TextDelta("Done.\n")]


def test_marker_split_across_chunks() -> None:
    """A marker split anywhere ("<tool" | "_call>") is held back, not emitted as text."""
    parser = OutputParser("hermes", call_id_prefix="t")
    assert parser.feed("Hi <tool") == [TextDelta("Hi")]
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "f"') == [ToolCallStart(0, "call_0_t", "f")]
    assert parser.feed(', "arguments": {"a"') == [ToolCallArgumentsDelta(0, '{"a"')]
    assert parser.feed(": 1}}</tool") == [ToolCallArgumentsDelta(0, ": 1}")]
    assert parser.feed("_call>") == [ToolCallEnd(0)]
    assert parser.finish() == []


def test_held_marker_prefix_released_when_not_a_marker() -> None:
    parser = OutputParser("hermes")
    assert parser.feed("a <tool") == [TextDelta("a")]
    assert parser.feed("box>") == [TextDelta(" <toolbox>")]


def test_close_tag_inside_json_string_does_not_end_call() -> None:
    args = '{"content": "x </tool_call> y"}'
    assert parse(hermes("write", args), chunk=1) == call(0, "write", args)


def test_arguments_before_name_are_buffered() -> None:
    """Not the streaming shape: parsed once closed, arguments re-serialised in one delta."""
    text = '<tool_call>{"arguments": {"b": 2, "a": 1}, "name": "f"}</tool_call>'
    assert parse(text, chunk=1) == call(0, "f", '{"b": 2, "a": 1}')


def test_malformed_json_is_text() -> None:
    """A body that is not JSON (and not the streaming header) comes out verbatim as text."""
    text = "See:\n<tool_call>\n{name: f}\n</tool_call>"
    assert parse(text, chunk=1) == [TextDelta(text)]


def test_no_arguments_after_name_gives_empty_object() -> None:
    assert parse('<tool_call>{"name": "f"}</tool_call>', chunk=1) == call(0, "f", "{}")


def test_unterminated_call_at_finish() -> None:
    """A started call is ended (arguments as produced); an unstarted one is a call only if it parses."""
    assert parse('<tool_call>{"name": "f", "arguments": {"a": 1', chunk=1) == call(0, "f", '{"a": 1')
    assert parse('<tool_call>{"arguments": {}, "name": "f"}', chunk=1) == call(0, "f", "{}")
    assert parse('x <tool_call>{"argu', chunk=1) == [TextDelta('x <tool_call>{"argu')]
    assert parse("x <tool_c", chunk=1) == [TextDelta("x <tool_c")]


def test_unknown_tool_is_text() -> None:
    text = hermes("rm", "{}")
    assert parse(text, tool_names=["read"]) == [TextDelta(text)]
    assert parse(text, tool_names=[]) == [TextDelta(text)]
    assert parse(text, tool_names=["rm"]) == call(0, "rm", "{}")


def test_format_none_is_all_text() -> None:
    text = hermes("read", "{}")
    assert parse(text, fmt="none", chunk=1) == [TextDelta(text)]


def test_unknown_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown tool format"):
        OutputParser("mistral")


def test_nothing_after_finish() -> None:
    parser = OutputParser("hermes")
    assert parser.feed("a <tool") == [TextDelta("a")]
    assert parser.finish() == [TextDelta(" <tool")]
    assert parser.feed("more") == []
    assert parser.finish() == []


def test_random_ids_differ_between_parsers() -> None:
    ids = set()
    for _ in range(2):
        events = run(OutputParser("hermes"), [hermes("f", "{}")])
        ids |= {e.id for e in events if isinstance(e, ToolCallStart)}
    assert len(ids) == 2
    assert all(i.startswith("call_0_") for i in ids)


# --- qwen3-coder


def coder(name: str, params: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("chunk", [0, 1, 5])
def test_coder_typed_parameters(chunk: int) -> None:
    """Numbers, booleans, objects and arrays are decoded; everything else stays a string, verbatim."""
    params = [
        ("n", "42"), ("x", "1.5"), ("ok", "true"), ("obj", '{"a": [1]}'), ("arr", "[1, 2]"),
        ("s", "hello"), ("null", "null"), ("quoted", '"q"'), ("multi", "line 1\n  line 2\n"),
    ]  # fmt: skip
    events = parse("Running.\n" + coder("run", params), fmt="qwen3-coder", chunk=chunk)
    assert events[0] == TextDelta("Running.")
    assert calls_of(events) == [
        (
            "run",
            {
                "n": 42, "x": 1.5, "ok": True, "obj": {"a": [1]}, "arr": [1, 2],
                "s": "hello", "null": "null", "quoted": '"q"', "multi": "line 1\n  line 2\n",
            },
        )
    ]  # fmt: skip


def test_coder_streams_per_parameter() -> None:
    parser = OutputParser("qwen3-coder", call_id_prefix="t")
    assert parser.feed("<tool_call>\n<function=write>\n") == [ToolCallStart(0, "call_0_t", "write")]
    assert parser.feed("<parameter=path>\na.py\n</parameter>\n") == [
        ToolCallArgumentsDelta(0, '{"path": "a.py"')
    ]
    assert parser.feed("<parameter=n>\n3\n</parameter>\n</function>") == [
        ToolCallArgumentsDelta(0, ', "n": 3}')
    ]
    assert parser.feed("\n</tool_call>") == [ToolCallEnd(0)]


def test_coder_two_calls_and_no_parameters() -> None:
    text = coder("a", []) + "\n" + coder("b", [("k", "v")]) + "\nok"
    assert parse(text, fmt="qwen3-coder", chunk=1) == call(0, "a", "{}") + call(1, "b", '{"k": "v"}') + [
        TextDelta("ok")
    ]


def test_coder_unterminated_parameter_is_dropped() -> None:
    text = "<tool_call>\n<function=w>\n<parameter=a>\n1\n</parameter>\n<parameter=body>\ntrunc"
    assert parse(text, fmt="qwen3-coder", chunk=1) == call(0, "w", '{"a": 1}')


def test_coder_malformed_is_text() -> None:
    text = "<tool_call>\nnot a function\n</tool_call>"
    assert parse(text, fmt="qwen3-coder", chunk=1) == [TextDelta(text)]


# --- reasoning


def test_reasoning_then_text_and_call() -> None:
    text = "<think>\nhmm\n</think>\n\nAnswer." + hermes("f", "{}")
    assert parse(text, chunk=1, reasoning=True) == [ReasoningDelta("\nhmm\n"), TextDelta("Answer.")] + call(
        0, "f", "{}"
    )


def test_reasoning_only_at_start() -> None:
    text = "x <think>y</think>"
    assert parse(text, chunk=1, reasoning=True) == [TextDelta(text)]


# --- stop strings


def test_stop_string_inside_text() -> None:
    parser = OutputParser("none", stop=["STOP"])
    assert merge(parser.feed("abcSTOPdef")) == [TextDelta("abc")]
    assert parser.stopped == "STOP"
    assert parser.feed("more") == []
    assert parser.finish() == []


def test_stop_string_across_chunks() -> None:
    parser = OutputParser("none", stop=["STOP"])
    assert parser.feed("abcS") == [TextDelta("abc")]
    assert parser.feed("TO") == []
    assert parser.stopped is None
    assert parser.feed("Pxyz") == []
    assert parser.stopped == "STOP"


def test_stop_prefix_then_mismatch_is_released() -> None:
    parser = OutputParser("none", stop=["STOP"])
    assert parser.feed("abST") == [TextDelta("ab")]
    assert parser.feed("x") == [TextDelta("STx")]
    assert parser.feed("S") == []
    assert parser.finish() == [TextDelta("S")]
    assert parser.stopped is None


def test_stop_first_completed_wins() -> None:
    """Generation stops where a stop string is first complete; on a tie the longest one wins."""
    parser = OutputParser("none", stop=["abcd", "bc"])
    assert merge(parser.feed("xabcd")) == [TextDelta("xa")]
    assert parser.stopped == "bc"
    parser = OutputParser("none", stop=["c", "bc"])
    assert merge(parser.feed("abc")) == [TextDelta("a")]
    assert parser.stopped == "bc"


def test_stop_inside_call_flushes_it() -> None:
    events = parse(hermes("f", '{"a": 1}') + "END", stop=["</tool_call>"])
    assert events == call(0, "f", '{"a": 1}')


# --- properties

PIECES = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=f>", "<parameter=a>", "</parameter>",
    "</function>", '{"name": "f", "arguments": ', '{"a": "<", "b": [1, {}]}', "}", '"', "\\", "\n", " ",
    "x", "<", "<tool", "</", "ST", "STOP", "é", "🙂", "1", "[",
]  # fmt: skip
chaos = st.lists(st.sampled_from(PIECES), max_size=25).map("".join)
cuts = st.lists(st.integers(min_value=0, max_value=200), max_size=12)
STOPS: list[tuple[str, ...]] = [(), ("STOP",), ("ST", "STOPS"), ("</tool_call>",)]


def split(text: str, points: Sequence[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_chunking(text: str, points: Sequence[int], **kwargs: object) -> list[OutputEvent]:
    whole = merge(run(OutputParser(call_id_prefix="t", **kwargs), [text]))  # type: ignore[arg-type]
    parser = OutputParser(call_id_prefix="t", **kwargs)  # type: ignore[arg-type]
    so_far: list[OutputEvent] = []
    for chunk in split(text, points):
        so_far = merge(so_far + parser.feed(chunk))
        # Nothing emitted is retracted: all but the last event are final, the last one is a prefix.
        if so_far:
            assert so_far[:-1] == whole[: len(so_far) - 1]
            last, target = so_far[-1], whole[len(so_far) - 1]
            if isinstance(last, TextDelta | ReasoningDelta | ToolCallArgumentsDelta):
                assert isinstance(target, type(last))
                assert target.text.startswith(last.text)
            else:
                assert last == target
    assert merge(so_far + parser.finish()) == whole
    return whole


@settings(max_examples=300, deadline=None)
@given(
    text=chaos,
    points=cuts,
    fmt=st.sampled_from(FORMATS),
    reasoning=st.booleans(),
    stop=st.sampled_from(STOPS),
)
def test_chunking_does_not_matter(
    text: str, points: list[int], fmt: str, reasoning: bool, stop: tuple[str, ...]
) -> None:
    """Any chunking gives the events of the whole text, and never emits what it later retracts."""
    check_chunking(text, points, tool_format=fmt, reasoning=reasoning, stop=stop)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abST \nO<P", max_size=40), points=cuts)
def test_stop_holds_back_at_most_longest_minus_one(text: str, points: list[int]) -> None:
    """Plain text is released except for at most max(len(stop)) - 1 characters."""
    parser = OutputParser("none", stop=["STOP", "aST"])
    fed = emitted = 0
    for chunk in split(text, points):
        fed += len(chunk)
        emitted += len(text_of(parser.feed(chunk)))
        if parser.stopped is None:
            assert fed - emitted <= 3
    emitted += len(text_of(parser.finish()))
    expected = text if parser.stopped is None else text[: text.index(parser.stopped)]
    assert emitted == len(expected)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
plain = st.text(alphabet="ab <>/{}\"\n'é", max_size=12)
NAMES = ["read", "write", "bash"]


def squash(text: str) -> str:
    return "".join(text.split())


@settings(max_examples=200, deadline=None)
@given(
    segments=st.lists(
        st.tuples(
            plain, st.sampled_from(NAMES), st.dictionaries(st.text(max_size=6), json_values, max_size=4)
        ),
        max_size=4,
    ),
    tail=plain,
    ascii_only=st.booleans(),
    points=cuts,
)
def test_hermes_round_trip(
    segments: list[tuple[str, str, dict[str, object]]], tail: str, ascii_only: bool, points: list[int]
) -> None:
    """Text and well-formed calls come back: the text (whitespace aside) and each call's arguments."""
    rendered = "".join(
        before
        + f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=ascii_only)}\n</tool_call>"
        for before, n, a in segments
    )
    expected_text = "".join(before for before, _, _ in segments) + tail
    assume(not any(t in expected_text for t in ("<tool_call", "</tool_call")))
    events = check_chunking(rendered + tail, points, tool_format="hermes")
    assert calls_of(events) == [(n, a) for _, n, a in segments]
    assert squash(text_of(events)) == squash(expected_text)


coder_values = st.one_of(
    st.integers(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.text(alphabet='ab 1<>/\n"{}[]é', max_size=20),
)


@settings(max_examples=200, deadline=None)
@given(
    segments=st.lists(
        st.tuples(
            plain,
            st.sampled_from(NAMES),
            st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=4), coder_values, max_size=4),
        ),
        max_size=3,
    ),
    tail=plain,
    points=cuts,
)
def test_coder_round_trip(
    segments: list[tuple[str, str, dict[str, object]]], tail: str, points: list[int]
) -> None:
    """Qwen3-Coder calls come back with typed parameters (strings that look like JSON excepted)."""
    for _, _, params in segments:
        for v in params.values():
            if isinstance(v, str):
                assume("</parameter>" not in v and _coder_value(f"\n{v}\n") == v)
    rendered = "".join(
        before + coder(n, [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in params.items()])
        for before, n, params in segments
    )
    expected_text = "".join(before for before, _, _ in segments) + tail
    assume("<tool_call" not in expected_text)
    events = check_chunking(rendered + tail, points, tool_format="qwen3-coder")
    assert calls_of(events) == [(n, p) for _, n, p in segments]
    assert squash(text_of(events)) == squash(expected_text)

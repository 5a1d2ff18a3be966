"""Streaming parser: the model's generated text, in arbitrary chunks, to `OutputEvent`s.

The parser knows nothing about tokens or APIs: it sees text (as the detokenizer releases it) and emits
`TextDelta`, `ReasoningDelta`, `ToolCallStart`, `ToolCallArgumentsDelta` and `ToolCallEnd` as early as is
safe, never anything it would later have to retract. `Finish` is the caller's business.

Pipeline (each stage holds back only what it must)::

    feed(chunk) -> stop filter -> format state machine -> events
                   holds the longest     holds a possible marker prefix ("<tool" of "<tool_call>"),
                   suffix that may       trailing whitespace before a possible call, and a call's
                   start a stop string   body until it is known to be a call

Stop strings. Generation stops at the first point where some stop string has been completely produced
(if several end there, the longest wins); `stopped` is then that string, the text before it is released,
everything is flushed (as `finish()` would) and later `feed()` calls return nothing. The caller aborts the
backend request. Stop strings apply to the raw output, tool-call markup included. The filter holds back
the longest suffix that is a proper prefix of some stop string, so at most max(len(stop)) - 1 characters
(the hold-back of vLLM's `IncrementalDetokenizer`,
https://github.com/vllm-project/vllm/blob/main/vllm/v1/engine/detokenizer.py); empty stop strings are ignored.

Reasoning (`reasoning=True`). Text inside `<think>...</think>` at the very start of the output is emitted
as `ReasoningDelta`, verbatim; whitespace right after `</think>` is dropped. If the output does not begin
with `<think>` there is no reasoning. NOTE(parser): chat templates that put `<think>` in the prompt (so the
output starts inside the reasoning) are not handled here yet.

Tool formats (`tool_format`):

- "none": everything is text.
- "hermes" (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`,
  possibly several in a row, text before, between and after them.
- "qwen3-coder" (Qwen3-Coder XML): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  ...\\n</function>\\n</tool_call>`.

Whitespace that separates text from a tool call (trailing whitespace before `<tool_call>`, leading
whitespace after `</tool_call>`) is dropped, so "Let me look.\\n\\n<tool_call>..." gives the text
"Let me look.". Text is otherwise verbatim.

Hermes calls are parsed incrementally by a small JSON scanner (the model writes the name first):

    <tool_call>\\n{"name": "f", "arguments": {"path": "a.py", "n": 1}}\\n</tool_call>
                 |-------------|              |------------------------|  |--------|
                 header: when the name's      streamed as raw argument   tail: ignored up to
                 closing quote arrives,       text as it arrives, up to  the closing tag
                 ToolCallStart is emitted     the brace that closes it

  Inside the arguments the scanner tracks strings and nesting, so "</tool_call>" inside a JSON string
  does not end the call; a "<" outside any string (not valid JSON there) ends the arguments early (the
  model closed the call without closing its braces; the arguments text is then truncated JSON).
  - The header deviates before the name is complete (e.g. "arguments" first, or not JSON at all): the
    body is buffered up to `</tool_call>` and then parsed with `json.loads`; a dict with a string "name"
    and "arguments" (or "parameters") becomes a call whose arguments arrive in one delta, re-serialised
    with `json.dumps` (key order kept). Anything else (malformed JSON) is emitted as text, verbatim,
    markup and the whitespace before it included.
  - The header deviates after the name (no "arguments" key, arguments not an object): the call has
    started, so it stays a call; at `</tool_call>` the body is parsed with `json.loads` and its
    arguments sent in one delta ("{}" if there are none or the body does not parse; a string value is
    taken to be the JSON text of the arguments).

Qwen3-Coder calls: `ToolCallStart` once `<function=NAME>` is complete; each parameter is sent when its
`</parameter>` arrives, as the next piece of one JSON object (`{"KEY": VALUE`, then `, "KEY": VALUE`, then
`}` at `</function>`). The single newline after `<parameter=KEY>` and the single newline before
`</parameter>` are removed; a value that parses as a JSON number, boolean, object or array is decoded,
anything else (null and quoted strings included) stays a string, verbatim.

Tool names. With `tool_names` given, a call naming another tool is emitted as text (its markup
verbatim) once it closes; with `tool_names` empty, tool-call markup is plain text.

Unterminated calls at `finish()` (or at a stop string):
- A call that has started (`ToolCallStart` sent) is ended with `ToolCallEnd`. Hermes: the arguments are
  whatever the model produced, possibly truncated JSON (the finish reason tells the client). Qwen3-Coder:
  a parameter whose `</parameter>` never came is dropped (a truncated file body must not look complete);
  the object is closed.
- A call that has not started: hermes tries `json.loads` on the body (a complete JSON call without its
  closing tag is still a call); otherwise the markup and body are emitted as text.

Tool call ids are `call_<index>_<tag>`, `tag` being `call_id_prefix` when given (deterministic ids for
tests) or 8 random hex digits per parser, so ids differ between responses of one conversation.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Sequence

from gateway.conversation import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)

TOOL_FORMATS: tuple[str, ...] = ("none", "hermes", "qwen3-coder")

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_WHITESPACE = " \t\r\n"

# Hermes header steps: literals, the name string, and the arguments key (two spellings).
_NAME = 0
_ARGS_KEY = 1
_HERMES_HEADER: tuple[str | int, ...] = ("{", '"name"', ":", _NAME, ",", _ARGS_KEY, ":", "{")


def _partial_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int:
    """Index just after the JSON string starting at `text[pos] == '"'`, or -1 if it is not complete yet."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return -1


def _reject_constant(name: str) -> object:
    raise ValueError(f"not a JSON constant: {name}")


def _coder_value(raw: str) -> object:
    """A Qwen3-Coder parameter value: numbers, booleans, objects and arrays decoded, else the string."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    try:
        value: object = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return raw
    if isinstance(value, bool | int | float | dict | list):
        return value
    return raw


def _arguments_text(value: object) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class _StopFilter:
    """Releases text up to the first completed stop string, holding back a possible stop-string prefix."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop if s)
        self._held = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, -len, stop): first end, then longest
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            self.stopped = best[2]
            self._held = ""
            return buf[: best[0] + best[1]]
        hold = _partial_len(buf, self._stops)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class OutputParser:
    """Turns generated text, fed in arbitrary chunks, into output events (see the module docstring)."""

    def __init__(
        self,
        tool_format: str,
        stop: Sequence[str] = (),
        tool_names: Collection[str] | None = None,
        reasoning: bool = False,
        call_id_prefix: str | None = None,
    ) -> None:
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool format {tool_format!r}; expected one of {TOOL_FORMATS}")
        self._format = tool_format if tool_names is None or len(tool_names) > 0 else "none"
        self._tool_names = frozenset(tool_names) if tool_names is not None else None
        self._tag = call_id_prefix if call_id_prefix is not None else secrets.token_hex(4)
        self._stop = _StopFilter(stop)
        self._state = "think_start" if reasoning else "text"
        self._buf = ""
        """Text released by the stop filter and not yet emitted; in a call, the call body from its start."""
        self._lstrip = False
        self._done = False
        self._n_calls = 0
        # The current call (state "call"); positions index into self._buf.
        self._sub = ""
        self._pre_ws = ""
        self._pos = 0
        self._step = 0
        self._started = False
        self._emit_from = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._n_params = 0
        self._key = ""
        self._value_start = 0

    @property
    def stopped(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self._stop.stopped

    def feed(self, text: str) -> list[OutputEvent]:
        if self._done:
            return []
        self._buf += self._stop.feed(text)
        out: list[OutputEvent] = []
        self._run(out, final=self._stop.stopped is not None)
        return out

    def finish(self) -> list[OutputEvent]:
        """Flushes everything held back; later calls to `feed` and `finish` return nothing."""
        if self._done:
            return []
        self._buf += self._stop.flush()
        out: list[OutputEvent] = []
        self._run(out, final=True)
        return out

    # --- driver and emitters

    def _run(self, out: list[OutputEvent], final: bool) -> None:
        while True:
            if self._state == "think_start":
                progressed = self._think_start(final)
            elif self._state == "reasoning":
                progressed = self._reasoning(out, final)
            elif self._state == "text":
                progressed = self._text(out, final)
            elif self._format == "hermes":
                progressed = self._hermes(out, final)
            else:
                progressed = self._coder(out, final)
            if not progressed:
                break
        if final:
            if self._buf:
                raise RuntimeError(
                    f"parser left {len(self._buf)} characters in state {self._state!r} at finish"
                )
            self._done = True

    @staticmethod
    def _emit_text(out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        if out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + text)
        else:
            out.append(TextDelta(text))

    @staticmethod
    def _emit_reasoning(out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        if out and isinstance(out[-1], ReasoningDelta):
            out[-1] = ReasoningDelta(out[-1].text + text)
        else:
            out.append(ReasoningDelta(text))

    def _emit_args(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        index = self._n_calls - 1
        last = out[-1] if out else None
        if isinstance(last, ToolCallArgumentsDelta) and last.index == index:
            out[-1] = ToolCallArgumentsDelta(index, last.text + text)
        else:
            out.append(ToolCallArgumentsDelta(index, text))

    def _allowed(self, name: str) -> bool:
        return bool(name) and (self._tool_names is None or name in self._tool_names)

    def _start_call(self, out: list[OutputEvent], name: str) -> None:
        index = self._n_calls
        self._n_calls += 1
        self._started = True
        out.append(ToolCallStart(index=index, id=f"call_{index}_{self._tag}", name=name))

    def _end_call(self, out: list[OutputEvent], consumed: int) -> None:
        """Ends the current call (as a call if started), consuming `self._buf[:consumed]`."""
        if self._started:
            out.append(ToolCallEnd(self._n_calls - 1))
            self._lstrip = True
        self._buf = self._buf[consumed:]
        self._state = "text"

    def _call_as_text(self, out: list[OutputEvent], end: int, closed: bool) -> None:
        """Emits the unrecognised call `<tool_call>` + buf[:end] (+ `</tool_call>`) as text."""
        self._emit_text(out, self._pre_ws + _OPEN + self._buf[:end] + (_CLOSE if closed else ""))
        self._end_call(out, end + len(_CLOSE) if closed else end)

    # --- reasoning and text

    def _think_start(self, final: bool) -> bool:
        if self._buf.startswith(_THINK_OPEN):
            self._buf = self._buf[len(_THINK_OPEN) :]
            self._state = "reasoning"
            return True
        if _THINK_OPEN.startswith(self._buf) and not final:
            return False
        self._state = "text"
        return True

    def _reasoning(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        i = buf.find(_THINK_CLOSE)
        if i >= 0:
            self._emit_reasoning(out, buf[:i])
            self._buf = buf[i + len(_THINK_CLOSE) :]
            self._state = "text"
            self._lstrip = True
            return True
        keep = 0 if final else _partial_len(buf, (_THINK_CLOSE,))
        self._emit_reasoning(out, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _text(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        if self._lstrip:
            stripped = buf.lstrip(_WHITESPACE)
            if not stripped:
                self._buf = ""
                return False
            buf = stripped
            self._lstrip = False
        if self._format == "none":
            self._emit_text(out, buf)
            self._buf = ""
            return False
        i = buf.find(_OPEN)
        if i >= 0:
            before = buf[:i].rstrip(_WHITESPACE)
            self._emit_text(out, before)
            self._begin_call(pre_ws=buf[len(before) : i], body=buf[i + len(_OPEN) :])
            return True
        if final:
            self._emit_text(out, buf)
            self._buf = ""
            return False
        # Hold back a possible "<tool_call>" prefix and the whitespace before it.
        cut = len(buf[: len(buf) - _partial_len(buf, (_OPEN,))].rstrip(_WHITESPACE))
        self._emit_text(out, buf[:cut])
        self._buf = buf[cut:]
        return False

    def _begin_call(self, pre_ws: str, body: str) -> None:
        self._state = "call"
        self._sub = "head"
        self._pre_ws = pre_ws
        self._buf = body
        self._pos = 0
        self._step = 0
        self._started = False
        self._emit_from = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._n_params = 0

    def _find_close(self) -> int:
        """Index of `</tool_call>` in the body from `self._pos`, or -1 (then skips what cannot hold it)."""
        i = self._buf.find(_CLOSE, self._pos)
        if i < 0:
            self._pos = max(self._pos, len(self._buf) - len(_CLOSE) + 1)
        return i

    # --- hermes

    def _hermes(self, out: list[OutputEvent], final: bool) -> bool:
        if self._sub == "head":
            result = self._hermes_head(out)
            if result == "more" and not final:
                return False
            if result == "done":
                self._sub = "args"
                self._depth = 1
                self._emit_from = self._pos - 1  # the arguments' opening brace
            else:  # "fail", or "more" at finish
                self._sub = "fallback" if self._started else "buffered"
                self._pos = 0
            return True
        if self._sub == "args":
            return self._hermes_args(out, final)
        if self._sub == "tail":
            i = self._find_close()
            if i < 0 and not final:
                return False
            self._end_call(out, i + len(_CLOSE) if i >= 0 else len(self._buf))
            return True
        # "buffered" (not started) or "fallback" (started): wait for the closing tag, then json.loads.
        i = self._find_close()
        if i < 0 and not final:
            return False
        end = i if i >= 0 else len(self._buf)
        try:
            body: object = json.loads(self._buf[:end])
        except (ValueError, RecursionError):
            body = None
        call = body if isinstance(body, dict) else {}
        args = call.get("arguments", call.get("parameters"))
        name = call.get("name")
        if not self._started:
            has_args = "arguments" in call or "parameters" in call
            if not (isinstance(name, str) and self._allowed(name) and has_args):
                self._call_as_text(out, end, closed=i >= 0)
                return True
            self._start_call(out, name)
        self._emit_args(out, _arguments_text(args))
        self._end_call(out, i + len(_CLOSE) if i >= 0 else end)
        return True

    def _hermes_head(self, out: list[OutputEvent]) -> str:
        """Advances through the header; "more" (need text), "fail" (not the streaming shape) or "done"."""
        buf = self._buf
        while self._step < len(_HERMES_HEADER):
            pos = _skip_ws(buf, self._pos)
            self._pos = pos
            if pos == len(buf):
                return "more"
            step = _HERMES_HEADER[self._step]
            if step == _NAME:
                if buf[pos] != '"':
                    return "fail"
                end = _string_end(buf, pos)
                if end < 0:
                    return "more"
                try:
                    name = json.loads(buf[pos:end])
                except ValueError:
                    return "fail"
                if not isinstance(name, str) or not self._allowed(name):
                    return "fail"
                self._pos = end
                self._step += 1
                self._start_call(out, name)
                continue
            literals = ('"arguments"', '"parameters"') if step == _ARGS_KEY else (str(step),)
            partial = False
            for literal in literals:
                seg = buf[pos : pos + len(literal)]
                if seg == literal:
                    self._pos = pos + len(literal)
                    self._step += 1
                    break
                partial = partial or literal.startswith(seg)
            else:
                return "more" if partial else "fail"
        return "done"

    def _hermes_args(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        i = self._pos
        ended = False
        depth, in_string, escape = self._depth, self._in_string, self._escape
        while i < len(buf):
            c = buf[i]
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    i += 1
                    ended = True
                    break
            elif c == "<":  # not JSON outside a string: the model closed the call early
                ended = True
                break
            i += 1
        self._depth, self._in_string, self._escape = depth, in_string, escape
        self._emit_args(out, buf[self._emit_from : i])
        # The arguments so far are sent: drop them, so a long argument does not make each feed copy it.
        self._buf = buf[i:]
        self._emit_from = self._pos = 0
        if ended:
            self._sub = "tail"
            return True
        if final:
            self._end_call(out, len(self._buf))
            return True
        return False

    # --- qwen3-coder

    def _coder(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        if self._sub == "head":
            pos = self._pos = _skip_ws(buf, self._pos)
            seg = buf[pos : pos + len(_FUNCTION)]
            if seg == _FUNCTION:
                j = buf.find(">", pos + len(_FUNCTION))
                name_part = buf[pos + len(_FUNCTION) : j if j >= 0 else len(buf)]
                bad = "<" in name_part or "\n" in name_part
                if j >= 0 and not bad and self._allowed(name_part.strip()):
                    self._start_call(out, name_part.strip())
                    self._pos = j + 1
                    self._sub = "body"
                    return True
                if j < 0 and not bad and not final:
                    return False
            elif _FUNCTION.startswith(seg) and not final:
                return False
            self._sub = "buffered"
            self._pos = 0
            return True
        if self._sub == "body":
            markers = (_PARAMETER, _FUNCTION_END, _CLOSE)
            found = [(k, m) for m in markers if (k := buf.find(m, self._pos)) >= 0]
            if not found:
                if final:
                    self._coder_close(out)
                    self._end_call(out, len(buf))
                    return True
                self._pos = max(self._pos, len(buf) - len(_CLOSE) + 1)
                return False
            k, marker = min(found)
            if marker == _PARAMETER:
                self._pos = k + len(_PARAMETER)
                self._sub = "key"
            elif marker == _FUNCTION_END:
                self._coder_close(out)
                self._pos = k + len(_FUNCTION_END)
                self._sub = "tail"
            else:
                self._coder_close(out)
                self._end_call(out, k + len(_CLOSE))
            return True
        if self._sub in ("key", "value"):
            if self._sub == "key":
                j = buf.find(">", self._pos)
                if j >= 0:
                    self._key = buf[self._pos : j].strip()
                    self._pos = self._value_start = j + 1
                    self._sub = "value"
                    return True
            else:
                k = buf.find(_PARAMETER_END, self._pos)
                if k >= 0:
                    value = _coder_value(buf[self._value_start : k])
                    key = json.dumps(self._key, ensure_ascii=False)
                    sep = "{" if self._n_params == 0 else ", "
                    self._emit_args(out, f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}")
                    self._n_params += 1
                    self._pos = k + len(_PARAMETER_END)
                    self._sub = "body"
                    return True
                self._pos = max(self._pos, len(buf) - len(_PARAMETER_END) + 1)
            if not final:
                return False
            self._coder_close(out)  # the unfinished parameter is dropped
            self._end_call(out, len(buf))
            return True
        i = self._find_close()
        if i < 0 and not final:
            return False
        if self._sub == "tail":
            self._end_call(out, i + len(_CLOSE) if i >= 0 else len(buf))
        else:  # "buffered": not a call we recognise
            self._call_as_text(out, i if i >= 0 else len(buf), closed=i >= 0)
        return True

    def _coder_close(self, out: list[OutputEvent]) -> None:
        self._emit_args(out, "}" if self._n_params else "{}")

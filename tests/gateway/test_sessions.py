"""Session identity from headers, body hints, or the conversation's opening."""

from __future__ import annotations

import json

from gateway.conversation import Conversation, Message
from gateway.sessions import SessionIdentity, identify

CLAUDE_SESSION = "168ee0e1-0e27-4ca7-ad1d-58c453f5ed19"


def conversation(*messages: Message, **hints: str) -> Conversation:
    return Conversation(model="m", messages=messages, session_hints=hints)


HELLO = conversation(Message("system", "be brief"), Message("user", "hi"))


def test_explicit_header_wins():
    headers = {"X-Loom-Session": "mine", "X-Claude-Code-Session-Id": CLAUDE_SESSION}
    assert identify(headers, HELLO) == SessionIdentity("mine", "explicit")


def test_claude_code_header_and_metadata_agree():
    user_id = json.dumps({"device_id": "ab" * 32, "account_uuid": "", "session_id": CLAUDE_SESSION})
    by_header = identify({"X-Claude-Code-Session-Id": CLAUDE_SESSION}, HELLO)
    by_body = identify({}, conversation(Message("user", "hi"), **{"metadata.user_id": user_id}))
    assert by_header == by_body == SessionIdentity(CLAUDE_SESSION, "claude-code")


def test_claude_code_subagents_are_sessions_of_their_own():
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION, "x-claude-code-agent-id": "0123456789abcdef0"}
    assert identify(headers, HELLO).key == f"{CLAUDE_SESSION}/agent-0123456789abcdef0"


def test_codex_thread_from_header_or_prompt_cache_key():
    thread = "0199a213-81c0-7800-8aa1-bbab2a035a53"
    assert identify({"session-id": thread}, HELLO) == SessionIdentity(thread, "codex")
    assert identify({}, conversation(Message("user", "hi"), prompt_cache_key=thread)).key == thread


def test_fingerprint_is_stable_across_turns_and_differs_between_openings():
    first = identify({}, HELLO)
    later = identify(
        {}, conversation(*HELLO.messages, Message("assistant", "hello"), Message("user", "more"))
    )
    other = identify({}, conversation(Message("system", "be brief"), Message("user", "bye")))
    assert first == later and first.source == "fingerprint"
    assert other.key != first.key


def test_malformed_metadata_falls_back_to_the_fingerprint():
    broken = conversation(Message("user", "hi"), **{"metadata.user_id": "not json"})
    assert identify({}, broken).source == "fingerprint"

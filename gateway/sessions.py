"""Session identity: which conversation a request continues, from what the client says about itself.

In order of precedence (clients.md §6):

1. `x-loom-session` header: an explicit key, for any client.
2. Claude Code: the `X-Claude-Code-Session-Id` header, or the `session_id` inside the JSON string
   `metadata.user_id` of the body. Subagents add `x-claude-code-agent-id` and are sessions of their own
   (`<session>/agent-<id>`): their histories do not extend the parent's.
3. Codex: the `session-id` header, or the body's `prompt_cache_key` (the same thread id).
4. Otherwise a fingerprint of the conversation's opening: its first system text and first user message.
   Turns of one conversation share it; two conversations that open identically share a key (and their
   cache) until they diverge, which costs nothing but a less precise per-session report.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.conversation import Conversation

Source = str  # "explicit", "claude-code", "codex" or "fingerprint"


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    key: str
    source: Source


def identify(headers: Mapping[str, str], conversation: Conversation) -> SessionIdentity:
    lowered = {name.lower(): value for name, value in headers.items()}
    base, source = _base(lowered, conversation)
    agent = lowered.get("x-claude-code-agent-id")
    if agent:
        return SessionIdentity(f"{base}/agent-{agent}", source)
    return SessionIdentity(base, source)


def _base(headers: Mapping[str, str], conversation: Conversation) -> tuple[str, Source]:
    if headers.get("x-loom-session"):
        return headers["x-loom-session"], "explicit"
    claude = headers.get("x-claude-code-session-id") or _claude_session_from_metadata(conversation)
    if claude:
        return claude, "claude-code"
    codex = headers.get("session-id") or conversation.session_hints.get("prompt_cache_key")
    if codex:
        return codex, "codex"
    return _fingerprint(conversation), "fingerprint"


def _claude_session_from_metadata(conversation: Conversation) -> str | None:
    user_id = conversation.session_hints.get("metadata.user_id")
    if not user_id:
        return None
    try:
        parsed = json.loads(user_id)
    except json.JSONDecodeError:
        return None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    return session if isinstance(session, str) and session else None


def _fingerprint(conversation: Conversation) -> str:
    system = next((m.content for m in conversation.messages if m.role == "system"), "")
    user = next((m.content for m in conversation.messages if m.role == "user"), "")
    digest = hashlib.sha256(json.dumps([conversation.model, system, user]).encode()).hexdigest()
    return f"fp-{digest[:16]}"

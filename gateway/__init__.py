"""Loom's gateway: one URL for Claude Code (Anthropic Messages), Codex (OpenAI Responses) and OpenAI Chat
Completions clients, in front of engines or SGLang servers."""

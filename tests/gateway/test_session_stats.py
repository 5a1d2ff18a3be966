"""Per-session stats: append ratio, hit rate, bounded registry."""

from __future__ import annotations

import pytest

from gateway.session_stats import SessionRegistry, common_prefix_length


def test_append_ratio_counts_prompt_tokens_extending_prompt_plus_output():
    registry = SessionRegistry()
    registry.record("s", "anthropic", "b0", prompt=[1, 2, 3], output=[4, 5], cached_tokens=0, ttft_s=0.5)
    assert registry.append_ratio_of("s", [1, 2, 3, 4, 5, 6, 7, 8]) == 5 / 8
    stats = registry.record(
        "s", "anthropic", "b0", [1, 2, 3, 4, 5, 6, 7, 8], [9], cached_tokens=4, ttft_s=0.1
    )
    assert stats.append_ratio == 5 / 8
    assert stats.hit_rate == 4 / 11
    stats = registry.record("s", "anthropic", "b0", [1, 2, 9, 9], [], cached_tokens=0, ttft_s=None)
    assert stats.append_ratio == (5 + 2) / (8 + 4)  # token-weighted over turns after the first
    assert stats.as_json()["turns"] == 3


def test_first_turn_has_no_append_ratio():
    registry = SessionRegistry()
    assert registry.append_ratio_of("new", [1, 2]) is None
    assert registry.record("new", "chat", "b0", [1, 2], [3], 0, None).append_ratio is None


def test_registry_keeps_only_the_most_recent_sessions():
    registry = SessionRegistry(max_sessions=2)
    for name in ("a", "b", "a", "c"):
        registry.record(name, "chat", "b0", [1], [2], 0, None)
    assert [s.session for s in registry.recent()] == ["c", "a"]
    assert registry.get("b") is None
    with pytest.raises(ValueError, match="max_sessions must be at least 1"):
        SessionRegistry(0)


@pytest.mark.parametrize(
    ("a", "b", "n"), [([], [1], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 9], [1, 2, 3], 2)]
)
def test_common_prefix_length(a, b, n):
    assert common_prefix_length(a, b, chunk=2) == n

"""Placement: sticky sessions, least loaded for new ones, failover when a backend is down."""

from __future__ import annotations

import pytest

from routing.placement import NoBackendAvailable, Placement


def test_new_sessions_go_to_the_least_loaded_backend_and_stay():
    placement = Placement(["a", "b"])
    assert placement.choose("s1") == "a"
    placement.started("a")
    assert placement.choose("s2") == "b"  # a has one request in flight
    placement.started("b")
    placement.started("b")
    assert placement.choose("s1") == "a"  # sticky even though it is not least loaded now
    assert placement.choose("s3") == "a"


def test_a_session_moves_when_its_backend_is_down_and_stays_moved():
    placement = Placement(["a", "b"])
    assert placement.choose("s") == "a"
    placement.mark_down("a")
    assert placement.choose("s") == "b"
    placement.mark_up("a")
    assert placement.choose("s") == "b"


def test_exclusion_and_no_backend_left():
    placement = Placement(["a", "b"])
    assert placement.choose("s", exclude=frozenset({"a"})) == "b"
    placement.mark_down("a")
    placement.mark_down("b")
    with pytest.raises(NoBackendAvailable):
        placement.choose("s")
    with pytest.raises(ValueError, match="at least one backend"):
        Placement([])

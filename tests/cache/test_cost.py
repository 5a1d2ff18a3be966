"""Tests for the Penelope cost model (backend/cache/cost.py)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.cache.cost import (
    HARDWARE,
    MODEL_SHAPES,
    Hardware,
    ModelShape,
    hardware_profile,
    model_shape,
    prefill_seconds,
    span_cost,
    spans_cost,
    token_cost,
    transfer_seconds,
    units_per_second,
)
from backend.cache.types import Span

QWEN3_8B = MODEL_SHAPES["qwen3-8b"]
H100 = HARDWARE["h100"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _deletion_speedup(shape: ModelShape, history_tokens: int, delete_start: int = 2048) -> float:
    """Paper's single-request experiment: cost(delete 30% from the end) / cost(delete 30% from delete_start).

    Either way the next request recomputes the deleted tokens at their original positions plus 512 appended.
    """
    num_deleted = round(0.3 * history_tokens)
    appended = Span(history_tokens, history_tokens + 512)
    front = [Span(delete_start, delete_start + num_deleted), appended]
    tail = [Span(history_tokens - num_deleted, history_tokens), appended]
    return spans_cost(shape, tail) / spans_cost(shape, front)


# ---------------------------------------------------------------- model shapes


def test_qwen3_8b_linear_units_are_exactly_23552() -> None:
    """The paper's figure: linear work per token equals 23,552 attention units."""
    assert QWEN3_8B.attention_macs_per_position == 8192
    assert QWEN3_8B.linear_macs_per_token == 4096 * 47_104
    assert QWEN3_8B.linear_units_per_token == 23_552


def test_qwen3_8b_kv_bytes_per_token() -> None:
    """36 layers * (K and V) * 8 heads * 128 dims * 2 bytes."""
    assert QWEN3_8B.kv_bytes_per_token == 147_456


def test_flops_per_unit_counts_two_flops_per_mac_over_all_layers() -> None:
    assert QWEN3_8B.flops_per_unit == 2 * 8192 * 36


@pytest.mark.parametrize(
    ("name", "linear_units", "kv_bytes"),
    [
        pytest.param("qwen3-32b", 29_760, 262_144, id="qwen3-32b"),
        pytest.param("smollm2-135m", 3_072, 23_040, id="smollm2-135m"),
    ],
)
def test_other_registered_shapes(name: str, linear_units: int, kv_bytes: int) -> None:
    """Qwen3-32B's q_dim (8192) differs from its hidden size (5120); the formula must use both."""
    shape = model_shape(name)
    assert shape.name == name
    assert shape.linear_units_per_token == linear_units
    assert shape.kv_bytes_per_token == kv_bytes


def test_kv_bytes_scale_with_element_size() -> None:
    fp8 = ModelShape("qwen3-8b-fp8", 36, 4096, 32, 8, 128, 12288, kv_bytes_per_element=1)
    assert fp8.kv_bytes_per_token == QWEN3_8B.kv_bytes_per_token // 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"name": ""}, "name must be a non-empty string", id="empty-name"),
        pytest.param({"num_layers": 0}, "num_layers must be a positive int", id="zero-layers"),
        pytest.param({"head_dim": -128}, "head_dim must be a positive int", id="negative"),
        pytest.param({"ffn_size": 1.5}, "ffn_size must be a positive int", id="float"),
        pytest.param({"hidden_size": True}, "hidden_size must be a positive int", id="bool"),
        pytest.param({"kv_bytes_per_element": 0}, "kv_bytes_per_element", id="zero-bytes"),
        pytest.param({"num_kv_heads": 5}, "multiple of num_kv_heads", id="gqa-groups"),
    ],
)
def test_model_shape_validation(overrides: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "name": "m",
        "num_layers": 2,
        "hidden_size": 64,
        "num_q_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "ffn_size": 128,
    }
    with pytest.raises(ValueError, match=message):
        ModelShape(**{**fields, **overrides})  # type: ignore[arg-type]


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'llama'") as excinfo:
        model_shape("llama")
    for name in MODEL_SHAPES:
        assert name in str(excinfo.value)


def test_unknown_hardware_lists_known_names() -> None:
    assert hardware_profile("h100") is H100
    with pytest.raises(ValueError, match="unknown hardware 'tpu'; known: h100"):
        hardware_profile("tpu")


# ---------------------------------------------------------------- costs


def test_token_cost_is_linear_units_plus_position() -> None:
    assert token_cost(QWEN3_8B, 0) == 23_552
    assert token_cost(QWEN3_8B, 131_072) == 23_552 + 131_072


@pytest.mark.parametrize(
    ("start", "end"),
    [
        pytest.param(0, 0, id="empty-at-0"),
        pytest.param(77, 77, id="empty-inside"),
        pytest.param(0, 1, id="first-token"),
        pytest.param(0, 1000, id="from-0"),
        pytest.param(2048, 4505, id="odd-length"),
        pytest.param(5000, 5512, id="even-length"),
    ],
)
def test_span_cost_equals_sum_of_token_costs(start: int, end: int) -> None:
    expected = sum(token_cost(QWEN3_8B, position) for position in range(start, end))
    assert span_cost(QWEN3_8B, start, end) == expected


@given(
    start=st.integers(min_value=0, max_value=300_000),
    first=st.integers(min_value=0, max_value=50_000),
    second=st.integers(min_value=0, max_value=50_000),
)
def test_span_cost_is_additive(start: int, first: int, second: int) -> None:
    """Splitting a span anywhere leaves its cost unchanged (the closed form stays exact)."""
    middle, end = start + first, start + first + second
    whole = span_cost(QWEN3_8B, start, end)
    assert whole == span_cost(QWEN3_8B, start, middle) + span_cost(QWEN3_8B, middle, end)
    assert spans_cost(QWEN3_8B, [Span(start, middle), Span(middle, end)]) == whole


def test_spans_cost_of_nothing_is_zero() -> None:
    assert spans_cost(QWEN3_8B, []) == 0


@pytest.mark.parametrize(
    ("start", "end"),
    [pytest.param(-1, 5, id="negative"), pytest.param(10, 9, id="inverted")],
)
def test_bad_spans_are_rejected(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="0 <= start <= end"):
        span_cost(QWEN3_8B, start, end)
    with pytest.raises(ValueError, match="0 <= start <= end"):
        spans_cost(QWEN3_8B, [Span(0, 4), Span(start, end)])


def test_negative_position_is_rejected() -> None:
    with pytest.raises(ValueError, match="position must be >= 0"):
        token_cost(QWEN3_8B, -1)


@pytest.mark.parametrize(
    ("history_tokens", "paper_speedup"),
    [pytest.param(8 * 1024, 1.14, id="8K"), pytest.param(128 * 1024, 2.93, id="128K")],
)
def test_paper_single_request_speedup_within_4_percent(history_tokens: int, paper_speedup: float) -> None:
    """Paper Fig. 1: deleting 30% from position 2K instead of from the end, then appending 512 tokens.

    The model predicts 1.110 at 8K (2.6% low) and 2.897 at 128K (1.1% low).
    """
    predicted = _deletion_speedup(QWEN3_8B, history_tokens)
    assert abs(predicted / paper_speedup - 1) <= 0.04


# ---------------------------------------------------------------- hardware


def test_h100_profile_is_about_28k_short_context_tokens_per_second() -> None:
    tokens_per_s = units_per_second(QWEN3_8B, H100) / QWEN3_8B.linear_units_per_token
    assert 28_000 <= tokens_per_s <= 29_000


def test_prefill_seconds_scales_linearly() -> None:
    spans = [Span(2048, 14_336), Span(40_000, 40_512)]
    once = prefill_seconds(QWEN3_8B, H100, spans)
    assert once == pytest.approx(spans_cost(QWEN3_8B, spans) * QWEN3_8B.flops_per_unit / 4.0e14)
    assert prefill_seconds(QWEN3_8B, H100, spans * 2) == pytest.approx(2 * once)
    twice_as_fast = Hardware("h100x2", 8.0e14, H100.decode_s_per_step, H100.host_bandwidth_bytes_per_s)
    assert prefill_seconds(QWEN3_8B, twice_as_fast, spans) == pytest.approx(once / 2)
    assert prefill_seconds(QWEN3_8B, H100, []) == 0


def test_transfer_seconds() -> None:
    assert transfer_seconds(QWEN3_8B, H100, 0) == 0
    assert transfer_seconds(QWEN3_8B, H100, 1000) == pytest.approx(1000 * 147_456 / 25e9)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        transfer_seconds(QWEN3_8B, H100, -1)


def test_from_measured_prefill_round_trips() -> None:
    """A profile built from a timed prefill predicts that same prefill's time."""
    shape = MODEL_SHAPES["smollm2-135m"]
    cpu = Hardware.from_measured_prefill(
        "cpu", shape, 4096, 2.5, decode_s_per_step=0.05, host_bandwidth_bytes_per_s=1e10
    )
    assert cpu.name == "cpu"
    assert cpu.effective_flops_per_s == pytest.approx(span_cost(shape, 0, 4096) * shape.flops_per_unit / 2.5)
    assert prefill_seconds(shape, cpu, [Span(0, 4096)]) == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("num_tokens", "seconds", "message"),
    [
        pytest.param(0, 1.0, "num_tokens must be a positive int", id="no-tokens"),
        pytest.param(100, 0.0, "seconds must be a positive finite number", id="zero-time"),
        pytest.param(100, math.inf, "seconds must be a positive finite number", id="inf-time"),
    ],
)
def test_from_measured_prefill_rejects_bad_measurements(
    num_tokens: int, seconds: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Hardware.from_measured_prefill(
            "cpu", QWEN3_8B, num_tokens, seconds, decode_s_per_step=0.05, host_bandwidth_bytes_per_s=1e10
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"name": ""}, "name must be a non-empty string", id="empty-name"),
        pytest.param({"effective_flops_per_s": 0.0}, "effective_flops_per_s must be", id="zero"),
        pytest.param({"decode_s_per_step": -0.02}, "decode_s_per_step must be", id="negative"),
        pytest.param({"host_bandwidth_bytes_per_s": math.nan}, "host_bandwidth_bytes_per_s", id="nan"),
        pytest.param({"decode_s_per_step": True}, "decode_s_per_step must be", id="bool"),
        pytest.param({"decode_s_per_step": "0.02"}, "decode_s_per_step must be", id="string"),
    ],
)
def test_hardware_validation(overrides: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "name": "hw",
        "effective_flops_per_s": 1e14,
        "decode_s_per_step": 0.02,
        "host_bandwidth_bytes_per_s": 25e9,
    }
    with pytest.raises(ValueError, match=message):
        Hardware(**{**fields, **overrides})  # type: ignore[arg-type]


def test_import_does_not_need_torch() -> None:
    """backend.cache is pure Python: importing the cost model with torch blocked must work."""
    code = "import sys; sys.modules['torch'] = None; import backend.cache.cost"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_plan_cost_counts_phantoms_and_the_requests_own_tokens():
    from backend.cache import CacheConfig, Tier, TieredCache
    from backend.cache.cost import plan_cost

    cache = TieredCache(CacheConfig(device_tokens=16, page_size=1))
    history = list(range(12))
    plan = cache.plan(cache.match(history[:-1]), 12)
    cache.lock(plan.last_node)
    admission = cache.admit(plan)
    cache.insert(history, admission.page_table)
    cache.unlock(plan.last_node)
    cache.evict(4, Tier.DEVICE)  # penelope: positions 0-3 become a hole
    prompt = [*history, 99]
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    shape = model_shape("qwen3-8b")
    assert plan_cost(shape, plan) == span_cost(shape, 0, 4) + span_cost(shape, 12, 13)

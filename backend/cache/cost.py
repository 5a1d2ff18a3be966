"""Penelope's recompute cost model: what it costs to prefill a token again, by position.

Under full causal attention a token at (0-based) position `p` attends to the `p` tokens before it, so the
later a token sits, the more it costs to recompute. Everything else a layer does per token (the Q/K/V/O
projections and the FFN) does not depend on position. Penelope (paper §2.2; literature.md §2) measures both
parts in one unit:

    1 unit = the attention work of one token against one extra earlier key, in one layer
           = 2 * num_q_heads * head_dim MACs                         (one row of QK^T plus one of AV)

Per layer and per token, with q_dim = num_q_heads * head_dim and kv_dim = num_kv_heads * head_dim:

    linear MACs = hidden * (q_dim + 2 * kv_dim)      Q, K, V projections
                + q_dim * hidden                      O projection
                + 3 * hidden * ffn_size               SwiGLU: gate, up, down

so a token at position p costs

    token_cost(p)      = linear_units + p,             linear_units = linear MACs / unit MACs
    span_cost([a, b))  = (b - a) * linear_units + (a + b - 1) * (b - a) / 2

For Qwen3-8B (hidden 4096, 32 Q heads and 8 KV heads of 128, FFN 12288) one unit is 8,192 MACs and
linear_units = 4096 * 47,104 / 8,192 = 23,552 exactly, so attention overtakes the linear layers at p ≈ 23.5K
and a token at 128K costs (23,552 + 131,072) / 23,552 ≈ 6.6 times a token at the front. Since every layer
has the same shape, the ratio holds summed over layers, and one unit summed over layers is
`flops_per_unit = 2 * unit MACs * num_layers` FLOPs (2 FLOPs per MAC).

The model ignores what is small or position-free at long context: norms, RoPE, softmax, embeddings and the
LM head (prefill computes logits for the last token only). It assumes full attention in every layer; for
sliding-window or linear-attention layers it overstates the cost of late tokens.

Times come from a `Hardware` profile:

    prefill_seconds  = span cost (units) * flops_per_unit / effective_flops_per_s
    transfer_seconds = num_tokens * kv_bytes_per_token / host_bandwidth_bytes_per_s

Knobs: the `ModelShape` fields (registered in `MODEL_SHAPES`) and the three `Hardware` rates (registered in
`HARDWARE`, or measured with `Hardware.from_measured_prefill`). Units are tokens, cost units, FLOPs, bytes
and seconds; names say which. Pure Python, standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from backend.cache.restore import RestorePlan
from backend.cache.types import Span

__all__ = [
    "HARDWARE",
    "MODEL_SHAPES",
    "Hardware",
    "ModelShape",
    "hardware_profile",
    "model_shape",
    "plan_cost",
    "prefill_seconds",
    "span_cost",
    "spans_cost",
    "token_cost",
    "transfer_seconds",
    "units_per_second",
]


##### Public API #####


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer with GQA and a SwiGLU FFN."""

    name: str
    """Registry name, e.g. "qwen3-8b"."""
    num_layers: int
    """Transformer layers; every one is assumed to use full causal attention."""
    hidden_size: int
    """Residual stream width (d_model)."""
    num_q_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA); must divide `num_q_heads`."""
    head_dim: int
    """Width of one attention head; need not be hidden_size / num_q_heads (Qwen3-32B: 64 * 128 != 5120)."""
    ffn_size: int
    """Intermediate width of the SwiGLU FFN (three matrices: gate, up, down)."""
    kv_bytes_per_element: int = 2
    """Bytes per cached K or V element: 2 for bf16/fp16, 1 for fp8."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelShape.name must be a non-empty string, got {self.name!r}")
        for field in (
            "num_layers",
            "hidden_size",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_size",
            "kv_bytes_per_element",
        ):
            _require_positive_int(f"ModelShape({self.name!r}).{field}", getattr(self, field))
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelShape({self.name!r}): num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_dim(self) -> int:
        """Width of all query heads together: num_q_heads * head_dim."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_macs_per_position(self) -> int:
        """MACs, per layer, for one token to attend to one more key (QK^T and AV). This is one cost unit."""
        return 2 * self.q_dim

    @property
    def linear_macs_per_token(self) -> int:
        """MACs, per layer, of the Q/K/V/O projections and the SwiGLU FFN for one token."""
        projections = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        return projections + 3 * self.hidden_size * self.ffn_size

    @property
    def linear_units_per_token(self) -> float:
        """Position-independent cost of one token in units (Qwen3-8B: exactly 23,552)."""
        return self.linear_macs_per_token / self.attention_macs_per_position

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cached per token over all layers (Qwen3-8B bf16: 147,456)."""
        return 2 * self.num_layers * self.kv_dim * self.kv_bytes_per_element

    @property
    def flops_per_unit(self) -> int:
        """FLOPs of one cost unit summed over all layers (2 FLOPs per MAC)."""
        return 2 * self.attention_macs_per_position * self.num_layers


@dataclass(frozen=True, slots=True)
class Hardware:
    """Throughputs of one accelerator (or CPU) serving one model; turns cost units into seconds.

    A profile is calibrated for the model it will serve: `effective_flops_per_s` is the rate that model's
    long prefills actually reach, not the datasheet peak.
    """

    name: str
    """Registry name, e.g. "h100"."""
    effective_flops_per_s: float
    """Achieved prefill FLOP/s, so that prefill_seconds = FLOPs / effective_flops_per_s."""
    decode_s_per_step: float
    """Wall time of one batched decode step (one new token for every running request)."""
    host_bandwidth_bytes_per_s: float
    """Effective host <-> device copy bandwidth for KV pages, in one direction."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Hardware.name must be a non-empty string, got {self.name!r}")
        for field in ("effective_flops_per_s", "decode_s_per_step", "host_bandwidth_bytes_per_s"):
            _require_positive_finite(f"Hardware({self.name!r}).{field}", getattr(self, field))

    @classmethod
    def from_measured_prefill(
        cls,
        name: str,
        shape: ModelShape,
        num_tokens: int,
        seconds: float,
        *,
        decode_s_per_step: float,
        host_bandwidth_bytes_per_s: float,
    ) -> Hardware:
        """Build a profile from one timed prefill of `num_tokens` tokens at positions [0, num_tokens).

        The effective FLOP/s is the model's cost of that span divided by the time, so `prefill_seconds` of
        the same span returns `seconds` again. Time a prompt long enough that attention shows (a few
        thousand tokens) and exclude warm-up. Raises ValueError for a non-positive count or time.
        """
        _require_positive_int("num_tokens", num_tokens)
        _require_positive_finite("seconds", seconds)
        flops = span_cost(shape, 0, num_tokens) * shape.flops_per_unit
        return cls(
            name=name,
            effective_flops_per_s=flops / seconds,
            decode_s_per_step=decode_s_per_step,
            host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s,
        )


def model_shape(name: str) -> ModelShape:
    """Return the registered shape called `name`; raise ValueError listing the known names if absent."""
    return _lookup(MODEL_SHAPES, name, "model")


def hardware_profile(name: str) -> Hardware:
    """Return the registered hardware called `name`; raise ValueError listing the known names if absent."""
    return _lookup(HARDWARE, name, "hardware")


def token_cost(shape: ModelShape, position: int) -> float:
    """Units to recompute one token at 0-based `position`: linear_units_per_token + position.

    Pure. Raises ValueError for a negative position.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return shape.linear_units_per_token + position


def span_cost(shape: ModelShape, start: int, end: int) -> float:
    """Units to recompute the tokens at positions [start, end), in closed form.

    Equals the sum of `token_cost` over the span: n * linear_units + (start + end - 1) * n / 2 with
    n = end - start; an empty span costs 0. Pure. Raises ValueError if start < 0 or end < start.
    """
    if start < 0 or end < start:
        raise ValueError(f"span [{start}, {end}) must satisfy 0 <= start <= end")
    num_tokens = end - start
    # n * (start + end - 1) is always even, so the attention term is an exact integer.
    return num_tokens * shape.linear_units_per_token + num_tokens * (start + end - 1) // 2


def spans_cost(shape: ModelShape, spans: Iterable[Span]) -> float:
    """Sum of `span_cost` over `spans`. Overlapping spans are counted twice. Pure; raises like span_cost."""
    return sum((span_cost(shape, span.start, span.end) for span in spans), 0.0)


def plan_cost(shape: ModelShape, plan: RestorePlan) -> float:
    """Cost units a request computes under `plan`: its phantom segments plus its own tokens."""
    return spans_cost(shape, (*plan.phantom_spans, plan.compute))


def units_per_second(shape: ModelShape, hardware: Hardware) -> float:
    """Cost units `hardware` prefills per second for `shape`."""
    return hardware.effective_flops_per_s / shape.flops_per_unit


def prefill_seconds(shape: ModelShape, hardware: Hardware, spans: Iterable[Span]) -> float:
    """Predicted time to prefill `spans` in one batch: spans_cost * flops_per_unit / effective FLOP/s."""
    return spans_cost(shape, spans) / units_per_second(shape, hardware)


def transfer_seconds(shape: ModelShape, hardware: Hardware, num_tokens: int) -> float:
    """Predicted time to copy the KV of `num_tokens` tokens between host and device, one direction.

    Raises ValueError for a negative count.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens * shape.kv_bytes_per_token / hardware.host_bandwidth_bytes_per_s


##### Internal Helper Functions #####

_T = TypeVar("_T")


def _lookup(registry: dict[str, _T], name: str, kind: str) -> _T:
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def _require_positive_int(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{label} must be a positive int, got {value!r}")


def _require_positive_finite(label: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{label} must be a positive finite number, got {value!r}")


##### Registries (built last: construction runs the validators above) #####

MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # Hugging Face config.json of each model (num_hidden_layers, hidden_size, num_attention_heads,
        # num_key_value_heads, head_dim, intermediate_size).
        ModelShape(
            "qwen3-8b",
            num_layers=36,
            hidden_size=4096,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=12288,
        ),
        ModelShape(
            "qwen3-32b",
            num_layers=64,
            hidden_size=5120,
            num_q_heads=64,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=25600,
        ),
        ModelShape(
            "smollm2-135m",
            num_layers=30,
            hidden_size=576,
            num_q_heads=9,
            num_kv_heads=3,
            head_dim=64,
            ffn_size=1536,
        ),
    )
}
"""Known model shapes by name; look them up with `model_shape(name)`."""

HARDWARE: dict[str, Hardware] = {
    # One H100 SXM serving Qwen3-8B in bf16. Assumptions, not measurements:
    # - prefill: ~40% of the 989 TFLOP/s dense BF16 peak, 4.0e14 FLOP/s, for long prefills; with
    #   23,552 units * 589,824 FLOP/unit ≈ 1.39e10 FLOP per short-context token this is ≈ 28.8K tokens/s;
    # - decode: one batched step ≈ 20 ms;
    # - host link: PCIe Gen5 x16 is 64 GB/s per direction on paper; ≈ 25 GB/s effective for paged KV copies.
    "h100": Hardware(
        name="h100",
        effective_flops_per_s=4.0e14,
        decode_s_per_step=0.02,
        host_bandwidth_bytes_per_s=25e9,
    ),
}
"""Known hardware profiles by name; look them up with `hardware_profile(name)`."""

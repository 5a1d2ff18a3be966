"""The single-request deletion experiment measured on the embedded engine (`single_request --engine`).

For each history length L the engine caches a history of L tokens whose first `delete_start` tokens are
a prefix shared with a second, more recent session, so that eviction walks no further up than the end
of that prefix. Then `d = round(fraction * L)` tokens are evicted through the policies themselves:

    front (penelope):  the earliest deletable pages of the private history -> hole [s, s + d)
    tail  (lru-block): the last pages of the history's leaf              -> deleted [L - d, L)

and the next request (history + `append_tokens` new tokens, one output token) is timed to its first
token: front recomputes the hole as a phantom segment in the same batch as the new tokens, tail
recomputes the lost end as ordinary prefill. Both recompute about d + a tokens.

The cost model predicts the same two times for the model's shape (`ModelShape` from the engine's
config) with a CPU `Hardware` calibrated from a measured prefill of `calibration_tokens` tokens from an
empty cache, never from a constant. Times are the best of `repeats` runs. The engine runs with one
`max_batch_tokens` chunk size for all cases.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from backend.cache import Span, Tier
from backend.cache.cost import Hardware, ModelShape, prefill_seconds
from backend.engine.config import ModelConfig, tiny_config
from backend.engine.engine import Engine, EngineConfig, Request
from backend.engine.model import Transformer
from backend.engine.sampling import SamplingParams
from backend.engine.weights import random_weights
from bench.single_request import EngineBench

PAGE_SIZE = 16


def model_shape_of(config: ModelConfig) -> ModelShape:
    return ModelShape(
        name=config.name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        ffn_size=config.intermediate_size,
        kv_bytes_per_element=4,
    )


def _tokens(count: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Transformer, policy: str, kv_cache_tokens: int, bench: EngineBench) -> Engine:
    config = EngineConfig(
        kv_cache_tokens=kv_cache_tokens,
        page_size=PAGE_SIZE,
        eviction_policy=policy,
        max_batch_tokens=bench.max_batch_tokens,
    )
    return Engine(model, config)


def _timed(engine: Engine, prompt: list[int]) -> tuple[float, Request]:
    request = Request(f"r{time.perf_counter_ns()}", prompt, SamplingParams(max_new_tokens=1, temperature=0))
    started = time.perf_counter()
    engine.generate([request])
    return time.perf_counter() - started, request


def measure_case(model: Transformer, policy: str, length: int, bench: EngineBench) -> tuple[float, Request]:
    """Best time to first token of the next request after deleting d tokens with `policy`."""
    vocab = model.config.vocab_size
    shared = _tokens(bench.delete_start, bench.seed, vocab)
    history = shared + _tokens(length - bench.delete_start, bench.seed + 1, vocab)
    other = shared + _tokens(PAGE_SIZE * 4, bench.seed + 2, vocab)
    appended = history + _tokens(bench.append_tokens, bench.seed + 3, vocab)
    num_deleted = round(bench.delete_fraction * length)
    best: tuple[float, Request] | None = None
    for _ in range(bench.repeats):
        engine = _engine(model, policy, 2 * length + 4 * bench.append_tokens, bench)
        engine.generate([Request("history", history, SamplingParams(max_new_tokens=1, temperature=0))])
        engine.generate([Request("other", other, SamplingParams(max_new_tokens=1, temperature=0))])
        engine.cache.evict(num_deleted, Tier.DEVICE)
        result = _timed(engine, appended)
        if best is None or result[0] < best[0]:
            best = result
    assert best is not None
    return best


def calibrate(model: Transformer, shape: ModelShape, bench: EngineBench) -> Hardware:
    """Effective FLOP/s of this engine on this CPU, from a timed prefill from an empty cache."""
    prompt = _tokens(bench.calibration_tokens, bench.seed + 9, model.config.vocab_size)
    seconds = min(
        _timed(_engine(model, "penelope", 2 * len(prompt), bench), prompt)[0] for _ in range(bench.repeats)
    )
    return Hardware.from_measured_prefill(
        "cpu-measured",
        shape,
        len(prompt),
        seconds,
        decode_s_per_step=seconds,
        host_bandwidth_bytes_per_s=1e10,
    )  # decode and host bandwidth are not used by this experiment


def run_engine_bench(bench: EngineBench) -> dict[str, Any]:
    torch.set_num_threads(bench.threads)
    config = tiny_config(num_layers=bench.num_layers, hidden_size=bench.hidden_size)
    positions = max(131072, 2 * max(bench.lengths))
    config = ModelConfig(**{**_fields(config), "max_position_embeddings": positions})
    model = Transformer(config)
    model.load_state_dict(random_weights(config, bench.seed), strict=False)
    model.eval()
    shape = model_shape_of(config)
    hardware = calibrate(model, shape, bench)
    rows = []
    for length in bench.lengths:
        front_s, front = measure_case(model, "penelope", length, bench)
        tail_s, tail = measure_case(model, "lru-block", length, bench)
        d, a = round(bench.delete_fraction * length), bench.append_tokens
        s = bench.delete_start
        predicted_front = prefill_seconds(shape, hardware, [Span(s, s + d), Span(length, length + a)])
        predicted_tail = prefill_seconds(shape, hardware, [Span(length - d, length + a)])
        rows.append(
            {
                "history_tokens": length,
                "deleted_tokens": d,
                "front_recomputed_tokens": len(front.prompt_ids) - front.cached_tokens,
                "tail_recomputed_tokens": len(tail.prompt_ids) - tail.cached_tokens,
                "front_phantom_tokens": front.recomputed_hole_tokens,
                "front_s": front_s,
                "tail_s": tail_s,
                "measured_speedup": tail_s / front_s,
                "predicted_front_s": predicted_front,
                "predicted_tail_s": predicted_tail,
                "predicted_speedup": predicted_tail / predicted_front,
            }
        )
    return {
        "model": config.name,
        "threads": bench.threads,
        "effective_gflops": hardware.effective_flops_per_s / 1e9,
        "delete_fraction": bench.delete_fraction,
        "delete_start": bench.delete_start,
        "append_tokens": bench.append_tokens,
        "rows": rows,
    }


def _fields(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def format_engine_table(report: dict[str, Any]) -> str:
    lines = [
        f"Single-request deletion measured on the engine ({report['model']}, {report['threads']} threads, "
        f"calibrated {report['effective_gflops']:.1f} GFLOP/s): delete {report['delete_fraction']:.0%} at "
        f"{report['delete_start']} (front, penelope) or at the end (tail, lru-block), append "
        f"{report['append_tokens']}",
        f"{'history':>9} {'front recomp':>12} {'tail recomp':>11} {'front_s':>8} {'tail_s':>8} "
        f"{'measured':>9} {'predicted':>9}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['history_tokens']:>9,} {row['front_recomputed_tokens']:>12,} "
            f"{row['tail_recomputed_tokens']:>11,} {row['front_s']:>8.3f} {row['tail_s']:>8.3f} "
            f"{row['measured_speedup']:>9.2f} "
            f"{row['predicted_speedup']:>9.2f}"
        )
    return "\n".join(lines)

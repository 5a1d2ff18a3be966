"""Single-request deletion experiment (Penelope paper, Fig. 1), predicted with the cost model.

The paper caches a history of L tokens on one H100 with Qwen3-8B, deletes about 30% of its KV, appends 512
tokens and times the next request. The deleted segment sits either at position 2K ("front") or at the end
("tail"); the next request recomputes it at its original positions, plus the appended tokens:

    front:  [0 .. s) kept | [s, s+d) deleted | [s+d, L) kept | [L, L+a) appended
    tail:   [0 .. L-d) kept                  | [L-d, L) deleted | [L, L+a) appended

    s = --delete-start, d = round(--delete-fraction * L), a = --append-tokens

Both cases recompute d + a tokens, so the linear-layer work is equal and the gap is attention: the tail's
tokens sit later. The predicted speedup is tail time / front time with `backend.cache.cost.prefill_seconds`;
the paper measured 1.14 at 8K and 2.93 at 128K. Predictions are prefill time only (time to first token
without queueing or decode), and the speedup does not depend on the hardware profile.

Run `python -m bench.single_request [--model M] [--hardware H] [--lengths 8K,128K] [--delete-fraction F]
[--delete-start S] [--append-tokens A]`. It prints a table, then, as the very last stdout line, one compact
JSON object: {"model", "hardware", "delete_fraction", "delete_start", "append_tokens", "rows": [{
"history_tokens", "deleted_tokens", "recomputed_tokens", "front_s", "tail_s", "predicted_speedup",
"paper_speedup" (null where the paper has no value for this setup)}]}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from backend.cache.cost import (
    HARDWARE,
    MODEL_SHAPES,
    Hardware,
    ModelShape,
    hardware_profile,
    model_shape,
    prefill_seconds,
)
from backend.cache.types import Span


@dataclass(frozen=True, slots=True)
class Workload:
    """What is deleted and appended; the defaults are the paper's setup."""

    delete_fraction: float = 0.3
    """Share of the history deleted, in (0, 1); rounded to whole tokens."""
    delete_start: int = 2048
    """Position where the front case's deleted segment starts."""
    append_tokens: int = 512
    """New tokens the next request appends after the history."""

    def __post_init__(self) -> None:
        if not 0 < self.delete_fraction < 1:
            raise ValueError(f"--delete-fraction must be in (0, 1), got {self.delete_fraction}")
        if self.delete_start < 0:
            raise ValueError(f"--delete-start must be >= 0, got {self.delete_start}")
        if self.append_tokens < 0:
            raise ValueError(f"--append-tokens must be >= 0, got {self.append_tokens}")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "qwen3-8b"
    """Name in `backend.cache.cost.MODEL_SHAPES`."""
    hardware: str = "h100"
    """Name in `backend.cache.cost.HARDWARE`."""
    lengths: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
    """History lengths L, in tokens."""
    workload: Workload = field(default_factory=Workload)


@dataclass(frozen=True, slots=True)
class EngineBench:
    """Settings of the measured variant (`--engine`, see `bench.engine_single_request`)."""

    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768)
    delete_fraction: float = 0.3
    delete_start: int = 2048
    append_tokens: int = 512
    num_layers: int = 2
    hidden_size: int = 64
    max_batch_tokens: int = 4096
    calibration_tokens: int = 2048
    repeats: int = 2
    threads: int = 2
    seed: int = 0


class Prediction(NamedTuple):
    history_tokens: int
    num_deleted_tokens: int
    num_recomputed_tokens: int
    front_s: float
    tail_s: float

    @property
    def predicted_speedup(self) -> float:
        """How much faster the next request is when the front segment was deleted instead of the tail."""
        return self.tail_s / self.front_s


PAPER_WORKLOAD = Workload()
PAPER_MODEL = "qwen3-8b"
PAPER_SPEEDUPS: dict[int, float] = {8 * 1024: 1.14, 128 * 1024: 2.93}
"""Measured speedups from the paper, valid only for PAPER_MODEL and PAPER_WORKLOAD."""


##### Experiment #####


def recompute_spans(history_tokens: int, workload: Workload) -> tuple[list[Span], list[Span]]:
    """Spans the next request prefills after a front deletion and after a tail deletion.

    Raises ValueError if the deleted segment is empty or does not fit in the history.
    """
    num_deleted = round(workload.delete_fraction * history_tokens)
    if num_deleted == 0:
        raise ValueError(
            f"--delete-fraction {workload.delete_fraction} of {history_tokens} tokens deletes nothing"
        )
    front_end = workload.delete_start + num_deleted
    if front_end > history_tokens:
        raise ValueError(
            f"the deleted segment [{workload.delete_start}, {front_end}) does not fit in a history of "
            f"{history_tokens} tokens; lower --delete-start or --delete-fraction, or drop that length"
        )
    appended = Span(history_tokens, history_tokens + workload.append_tokens)
    front = [Span(workload.delete_start, front_end), appended]
    tail = [Span(history_tokens - num_deleted, history_tokens), appended]
    return front, tail


def predict(shape: ModelShape, hardware: Hardware, history_tokens: int, workload: Workload) -> Prediction:
    """Predicted next-request prefill time for both deletion cases at one history length."""
    front, tail = recompute_spans(history_tokens, workload)
    return Prediction(
        history_tokens=history_tokens,
        num_deleted_tokens=front[0].num_tokens,
        num_recomputed_tokens=sum(span.num_tokens for span in front),
        front_s=prefill_seconds(shape, hardware, front),
        tail_s=prefill_seconds(shape, hardware, tail),
    )


def paper_speedup(config: BenchConfig, history_tokens: int) -> float | None:
    """The paper's measured speedup for this point, or None if the paper did not measure this setup."""
    if config.model != PAPER_MODEL or config.workload != PAPER_WORKLOAD:
        return None
    return PAPER_SPEEDUPS.get(history_tokens)


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the experiment and return the JSON-ready report. Raises ValueError for a bad config."""
    shape = model_shape(config.model)
    hardware = hardware_profile(config.hardware)
    rows = []
    for history_tokens in config.lengths:
        prediction = predict(shape, hardware, history_tokens, config.workload)
        rows.append(
            {
                "history_tokens": history_tokens,
                "deleted_tokens": prediction.num_deleted_tokens,
                "recomputed_tokens": prediction.num_recomputed_tokens,
                "front_s": prediction.front_s,
                "tail_s": prediction.tail_s,
                "predicted_speedup": prediction.predicted_speedup,
                "paper_speedup": paper_speedup(config, history_tokens),
            }
        )
    return {
        "model": config.model,
        "hardware": config.hardware,
        "delete_fraction": config.workload.delete_fraction,
        "delete_start": config.workload.delete_start,
        "append_tokens": config.workload.append_tokens,
        "rows": rows,
    }


##### Command line #####


def parse_num_tokens(text: str) -> int:
    """Parse a token count such as "8192", "8K" or "1M" (K = 1024, M = 1024 * 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 8192 or 8K)")
    scale = {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
    num_tokens = int(match.group(1)) * scale
    if num_tokens <= 0:
        raise argparse.ArgumentTypeError(f"a history length must be positive, got {text!r}")
    return num_tokens


def parse_lengths(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of token counts, e.g. "8K,16K,131072"."""
    return tuple(parse_num_tokens(item) for item in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    defaults, workload = BenchConfig(), Workload()
    parser = argparse.ArgumentParser(
        prog="python -m bench.single_request",
        description="Predict the paper's single-request deletion speedup (front vs tail) by cost model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=defaults.model, choices=sorted(MODEL_SHAPES), help="model shape")
    parser.add_argument(
        "--hardware", default=defaults.hardware, choices=sorted(HARDWARE), help="hardware profile"
    )
    parser.add_argument(
        "--lengths",
        type=parse_lengths,
        default=None,
        help="comma-separated history lengths in tokens, e.g. 8K,16K or 8192 (K = 1024); "
        f"default {','.join(str(n) for n in defaults.lengths)}, with --engine "
        f"{','.join(str(n) for n in EngineBench().lengths)}",
    )
    parser.add_argument(
        "--delete-fraction", type=float, default=workload.delete_fraction, help="share of the history deleted"
    )
    parser.add_argument(
        "--delete-start", type=int, default=workload.delete_start, help="front case: first deleted position"
    )
    parser.add_argument(
        "--append-tokens", type=int, default=workload.append_tokens, help="new tokens in the next request"
    )
    engine = parser.add_argument_group("measured on the embedded engine (tiny random model on this CPU)")
    engine.add_argument("--engine", action="store_true", help="measure instead of predicting")
    engine.add_argument("--engine-layers", type=int, default=EngineBench().num_layers)
    engine.add_argument("--engine-hidden", type=int, default=EngineBench().hidden_size)
    engine.add_argument("--threads", type=int, default=EngineBench().threads, help="torch threads")
    engine.add_argument("--repeats", type=int, default=EngineBench().repeats, help="best of this many runs")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig | EngineBench:
    """Parse and validate the command line; any bad value exits with status 2 and a message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    lengths = args.lengths or (EngineBench().lengths if args.engine else BenchConfig().lengths)
    try:
        workload = Workload(args.delete_fraction, args.delete_start, args.append_tokens)
        for history_tokens in lengths:
            recompute_spans(history_tokens, workload)
    except ValueError as exc:
        parser.error(str(exc))
    if args.engine:
        return EngineBench(
            lengths=lengths,
            delete_fraction=workload.delete_fraction,
            delete_start=workload.delete_start,
            append_tokens=workload.append_tokens,
            num_layers=args.engine_layers,
            hidden_size=args.engine_hidden,
            repeats=args.repeats,
            threads=args.threads,
        )
    return BenchConfig(args.model, args.hardware, lengths, workload)


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"Single-request deletion on {report['model']} / {report['hardware']}: delete "
        f"{report['delete_fraction']:.0%} at position {report['delete_start']} (front) or at the end "
        f"(tail), then append {report['append_tokens']} tokens",
        f"{'history':>9} {'deleted':>8} {'recomputed':>10} {'front_s':>9} {'tail_s':>9} "
        f"{'speedup':>8} {'paper':>6}",
    ]
    for row in report["rows"]:
        paper = "-" if row["paper_speedup"] is None else f"{row['paper_speedup']:.2f}"
        lines.append(
            f"{row['history_tokens']:>9,} {row['deleted_tokens']:>8,} {row['recomputed_tokens']:>10,} "
            f"{row['front_s']:>9.4f} {row['tail_s']:>9.4f} {row['predicted_speedup']:>8.3f} {paper:>6}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    if isinstance(config, EngineBench):
        from bench.engine_single_request import format_engine_table, run_engine_bench

        report = run_engine_bench(config)
        print(format_engine_table(report))
        print(json.dumps(report, separators=(",", ":")))
        return 0
    report = run(config)
    print(format_table(report))
    print(json.dumps(report, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay real Claude Code traces through the cache-policy core on a simulated accelerator.

    python -m bench.simulate --policies lru,penelope --sessions 4 --device-tokens 256K

Every policy replays the same sessions (the first `--trace-files` trace files in name order, subagents
as sessions of their own) with the same synthesized tokens (`--seed`), the same cache sizes and the same
serving model (`bench.serving_model`: chunked prefill timed by the cost model on `--hardware`, batched
decode, `--scheduler lpm|fcfs`, `--sessions` running at once, recorded think times). Prints a side-by-side
table and, as the last line, one JSON object:
`{"policies": {"<name>": {"mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "hit_rate", "recomputed_tokens",
"recompute_cost_units", "mean_jct_s", ...}}, "sessions": N, "requests": R}`.

Hit rate is token-weighted: prompt tokens served from cache (device hits plus host loads) over all prompt
tokens. Recomputed tokens are prompt tokens computed again after eviction (see `bench.serving_model`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from backend.cache import POLICIES, CacheConfig, TieredCache
from backend.cache.cost import HARDWARE, MODEL_SHAPES, hardware_profile, model_shape
from bench.serving_model import SCHEDULERS, RequestRecord, ServingConfig, SimulationResult, Simulator
from bench.traces import Session, TokenSynthesizer, TraceFormatError, load_traces

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "claude-code"


def parse_tokens(text: str) -> int:
    """`262144`, `256K` or `1M` (K = 1024) as a token count."""
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 262144 or 256K)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"token count must be >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="directory of trace files")
    parser.add_argument("--trace-files", type=int, default=24, help="trace files to replay, in name order")
    parser.add_argument("--policies", default=",".join(POLICIES.names()), help="comma-separated policies")
    parser.add_argument("--sessions", type=int, default=4, help="sessions running at once")
    parser.add_argument("--device-tokens", type=parse_tokens, default=256 * 1024)
    parser.add_argument("--host-tokens", type=parse_tokens, default=0)
    parser.add_argument("--swap-buffer-tokens", type=parse_tokens, default=1024)
    parser.add_argument(
        "--page-size", type=int, default=64, help="tokens per KV page (the traces' block size)"
    )
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    parser.add_argument("--scheduler", default="lpm", choices=SCHEDULERS)
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--max-requests", type=int, default=None, help="stop issuing after this many")
    parser.add_argument("--think-scale", type=float, default=1.0, help="multiply recorded think times")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthesized tokens")
    parser.add_argument("--csv", type=Path, default=None, help="write one row per request here")
    return parser


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarize(result: SimulationResult) -> dict[str, float]:
    records = result.requests
    ttfts = [r.ttft_s for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    served = sum(r.cached_tokens + r.loaded_tokens for r in records)
    return {
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else 0.0,
        "p50_ttft_s": _percentile(ttfts, 0.5),
        "p90_ttft_s": _percentile(ttfts, 0.9),
        "hit_rate": served / prompt if prompt else 0.0,
        "device_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "phantom_tokens": sum(r.phantom_tokens for r in records),
        "recompute_cost_units": sum(r.recompute_cost_units for r in records),
        "mean_jct_s": statistics.fmean(result.session_times_s.values()) if result.session_times_s else 0.0,
        "requests": len(records),
        "skipped_requests": result.skipped_requests,
        "makespan_s": result.makespan_s,
    }


def simulate(args: argparse.Namespace, policy: str, sessions: list[Session]) -> SimulationResult:
    cache = TieredCache(
        CacheConfig(
            device_tokens=args.device_tokens,
            page_size=args.page_size,
            host_tokens=args.host_tokens,
            swap_buffer_tokens=args.swap_buffer_tokens,
            eviction_policy=policy,
        )
    )
    serving = ServingConfig(
        num_slots=args.sessions,
        scheduler=args.scheduler,
        max_batch_tokens=args.max_batch_tokens,
        think_scale=args.think_scale,
        max_requests=args.max_requests,
    )
    synthesizer = TokenSynthesizer(seed=args.seed)
    simulator = Simulator(
        cache, model_shape(args.model), hardware_profile(args.hardware), serving, synthesizer.prompt_tokens
    )
    return simulator.run(sessions)


def print_table(summaries: dict[str, dict[str, float]]) -> None:
    columns = [
        ("hit rate", "hit_rate", "{:.3f}"),
        ("recomputed tok", "recomputed_tokens", "{:,.0f}"),
        ("recompute cost (G units)", "recompute_cost_units", "{:,.1f}"),
        ("mean TTFT s", "mean_ttft_s", "{:.3f}"),
        ("p50 TTFT s", "p50_ttft_s", "{:.3f}"),
        ("p90 TTFT s", "p90_ttft_s", "{:.3f}"),
        ("mean JCT s", "mean_jct_s", "{:,.1f}"),
    ]
    print(
        f"{'policy':<10}"
        + "".join(f"{title:>26}" if "cost" in title else f"{title:>15}" for title, _, _ in columns)
    )
    for name, summary in summaries.items():
        cells = []
        for title, key, fmt in columns:
            value = summary[key] / 1e9 if key == "recompute_cost_units" else summary[key]
            cells.append(f"{fmt.format(value):>26}" if "cost" in title else f"{fmt.format(value):>15}")
        print(f"{name:<10}" + "".join(cells))


def write_csv(path: Path, rows: list[tuple[str, RequestRecord]]) -> None:
    fields = [
        "session_id", "index", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s", "finish_s",
        "cached_tokens", "loaded_tokens", "phantom_tokens", "computed_tokens", "recomputed_tokens",
        "recompute_cost_units",
    ]  # fmt: skip
    with path.open("w") as out:
        out.write("policy," + ",".join(fields) + ",ttft_s\n")
        for policy, record in rows:
            values = [str(getattr(record, name)) for name in fields]
            out.write(f"{policy},{','.join(values)},{record.ttft_s}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES.names()]
    if unknown or not policies:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES.names())}")
    try:
        CacheConfig(args.device_tokens, args.page_size, args.host_tokens, args.swap_buffer_tokens)
        ServingConfig(
            args.sessions, args.scheduler, args.max_batch_tokens, args.think_scale, args.max_requests
        )
        sessions = load_traces(args.traces, limit=args.trace_files)
    except (ValueError, OSError) as error:
        kind = "trace error" if isinstance(error, TraceFormatError) else "bad option"
        parser.error(f"{kind}: {error}")
    summaries: dict[str, dict[str, float]] = {}
    rows: list[tuple[str, RequestRecord]] = []
    for policy in policies:
        started = time.perf_counter()
        result = simulate(args, policy, sessions)
        summaries[policy] = summarize(result)
        rows.extend((policy, record) for record in result.requests)
        print(
            f"# {policy}: {len(result.requests)} requests in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    print(
        f"{len(sessions)} sessions, {args.sessions} at once, {args.model} on {args.hardware}, "
        f"device {args.device_tokens:,} + host {args.host_tokens:,} tokens, "
        f"page {args.page_size}, {args.scheduler}"
    )
    print_table(summaries)
    if args.csv:
        write_csv(args.csv, rows)
    first = next(iter(summaries.values()))
    print(json.dumps({"policies": summaries, "sessions": len(sessions), "requests": first["requests"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tests for the single-request deletion benchmark (bench/single_request.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backend.cache.cost import HARDWARE, MODEL_SHAPES
from backend.cache.types import Span
from bench.single_request import (
    BenchConfig,
    Workload,
    main,
    parse_num_tokens,
    predict,
    recompute_spans,
    run,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out.splitlines()[-1])
    return report


def test_default_run_prints_table_then_json_last(capsys: pytest.CaptureFixture[str]) -> None:
    report = _run_main([], capsys)
    assert report["model"] == "qwen3-8b"
    assert report["hardware"] == "h100"
    rows = report["rows"]
    assert [row["history_tokens"] for row in rows] == [8192, 16384, 32768, 65536, 131072]
    speedups = [row["predicted_speedup"] for row in rows]
    assert speedups == sorted(speedups)
    assert speedups[0] > 1
    for row in rows:
        assert row["predicted_speedup"] == pytest.approx(row["tail_s"] / row["front_s"])


def test_default_run_matches_paper_within_4_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """Only 8K and 128K carry the paper's measurements (1.14 and 2.93)."""
    rows = _run_main([], capsys)["rows"]
    with_paper = {row["history_tokens"]: row for row in rows if row["paper_speedup"] is not None}
    assert sorted(with_paper) == [8192, 131072]
    for row in with_paper.values():
        assert abs(row["predicted_speedup"] / row["paper_speedup"] - 1) <= 0.04


def test_options_are_applied(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "smollm2-135m", "--lengths", "16k,32768", "--delete-fraction", "0.5"]
    argv += ["--delete-start", "1024", "--append-tokens", "0"]
    report = _run_main(argv, capsys)
    assert report["model"] == "smollm2-135m"
    assert [row["history_tokens"] for row in report["rows"]] == [16384, 32768]
    first = report["rows"][0]
    assert first["deleted_tokens"] == first["recomputed_tokens"] == 8192
    assert first["paper_speedup"] is None, "the paper measured only Qwen3-8B with its own workload"


def test_paper_values_only_for_paper_setup() -> None:
    config = BenchConfig(lengths=(8192,), workload=Workload(delete_start=1024))
    assert run(config)["rows"][0]["paper_speedup"] is None


def test_recompute_spans_for_paper_setup() -> None:
    """Both cases recompute the deleted 30% plus the 512 appended tokens, at their original positions."""
    front, tail = recompute_spans(8192, Workload())
    assert front == [Span(2048, 4506), Span(8192, 8704)]
    assert tail == [Span(5734, 8192), Span(8192, 8704)]


def test_predict_counts_tokens() -> None:
    prediction = predict(MODEL_SHAPES["qwen3-8b"], HARDWARE["h100"], 131072, Workload())
    assert prediction.num_deleted_tokens == 39322
    assert prediction.num_recomputed_tokens == 39322 + 512
    assert prediction.front_s < prediction.tail_s


@pytest.mark.parametrize(
    ("text", "num_tokens"),
    [("8192", 8192), ("8K", 8192), ("128k", 131072), ("1M", 1048576), (" 16K ", 16384)],
)
def test_parse_num_tokens(text: str, num_tokens: int) -> None:
    assert parse_num_tokens(text) == num_tokens


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--lengths", "2K"], "does not fit in a history of 2048 tokens", id="segment-too-long"),
        pytest.param(["--lengths", "8X"], "not a token count", id="bad-length"),
        pytest.param(["--lengths", "0"], "must be positive", id="zero-length"),
        pytest.param(["--delete-fraction", "1.5"], "must be in (0, 1)", id="fraction"),
        pytest.param(["--delete-fraction", "nan"], "must be in (0, 1)", id="nan-fraction"),
        pytest.param(["--delete-start", "-1"], "--delete-start must be >= 0", id="negative-start"),
        pytest.param(["--append-tokens", "-5"], "--append-tokens must be >= 0", id="negative-append"),
        pytest.param(["--model", "llama"], "invalid choice", id="unknown-model"),
        pytest.param(["--hardware", "tpu"], "invalid choice", id="unknown-hardware"),
        pytest.param(["--engine", "--lengths", "2K"], "does not fit", id="engine-segment-too-long"),
    ],
)
def test_bad_arguments_exit_2_with_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_module_entry_point() -> None:
    """`python -m bench.single_request` works end to end; a bad argument is an error line, not a traceback."""
    command = [sys.executable, "-m", "bench.single_request", "--lengths", "8K,128K"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert len(json.loads(done.stdout.splitlines()[-1])["rows"]) == 2

    bad = subprocess.run([*command[:3], "--lengths", "1K"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "error:" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_engine_mode_measures_both_cases_on_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """`--engine`: the same workload measured on a tiny engine, with the calibrated prediction beside it."""
    argv = ["--engine", "--lengths", "3K", "--append-tokens", "64", "--repeats", "1", "--threads", "1"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    (row,) = report["rows"]
    assert row["front_recomputed_tokens"] == row["tail_recomputed_tokens"] > 0.3 * 3072
    assert row["front_phantom_tokens"] > 0
    assert row["measured_speedup"] > 0 and row["predicted_speedup"] > 1
    assert report["effective_gflops"] > 0

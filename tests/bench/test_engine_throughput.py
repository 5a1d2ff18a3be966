"""`python -m bench.engine_throughput` on the tiny model: both sides run and the report is complete."""

from __future__ import annotations

import json

import pytest

from bench.engine_throughput import main


def test_tiny_model_report(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--lengths", "64", "--decode-tokens", "4", "--repeats", "1", "--threads", "1"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    (row,) = report["rows"]
    assert row["prompt_tokens"] == 64
    assert row["engine_prefill_tok_s"] > 0 and row["hf_prefill_tok_s"] > 0
    assert row["prefill_ratio"] > 0 and row["decode_ratio"] > 0


def test_bad_lengths_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--lengths", "12,abc"])
    assert exit_info.value.code == 2
    assert "--lengths must be comma-separated integers" in capsys.readouterr().err

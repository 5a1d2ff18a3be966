"""`python -m bench.simulate` end to end on a few real traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.simulate import main, parse_tokens

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "claude-code"
requires_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real traces not found at {TRACES}")


@requires_traces
def test_side_by_side_table_and_json_last_line(capsys, tmp_path):
    csv = tmp_path / "requests.csv"
    argv = ["--trace-files", "2", "--max-requests", "12", "--device-tokens", "128K", "--csv", str(csv)]
    assert main([*argv, "--policies", "lru,penelope"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split()[:3] == ["policy", "hit", "rate"]
    assert [line.split()[0] for line in lines[2:4]] == ["lru", "penelope"]
    report = json.loads(lines[-1])
    assert set(report["policies"]) == {"lru", "penelope"}
    for summary in report["policies"].values():
        assert {"mean_ttft_s", "p90_ttft_s", "hit_rate", "recomputed_tokens", "mean_jct_s"} <= set(summary)
        assert summary["requests"] == 12
        assert 0.5 < summary["hit_rate"] <= 1.0  # the traces mostly append
    assert len(csv.read_text().splitlines()) == 1 + 2 * 12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "lru,mru"], "unknown policies ['mru']"),
        (["--traces", "/nonexistent"], "trace error"),
        (["--device-tokens", "lots"], "not a token count: 'lots'"),
        (["--device-tokens", "100", "--page-size", "64"], "device_tokens must be a non-negative multiple"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_tokens():
    assert (parse_tokens("256K"), parse_tokens("1M"), parse_tokens("4096")) == (262144, 1 << 20, 4096)

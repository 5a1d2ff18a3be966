"""The `loom` command line: subcommands, flags, and errors as argparse errors."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser, main


def test_subcommands_and_defaults():
    args = build_parser().parse_args(["serve", "--model", "tiny"])
    assert (args.command, args.model, args.port, args.engine_port, args.eviction_policy) == (
        "serve", "tiny", 8000, 30000, "penelope",
    )  # fmt: skip
    gateway = build_parser().parse_args(["gateway", "--backend", "http://a:1", "--backend", "http://b:2"])
    assert gateway.backend == ["http://a:1", "http://b:2"]


def test_gateway_needs_a_backend(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gateway"])
    assert exit_info.value.code == 2
    assert "--backend" in capsys.readouterr().err


def test_bad_gateway_settings_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gateway", "--backend", "http://a:1", "--max-output-tokens", "0"])
    assert exit_info.value.code == 2
    assert "must be positive" in capsys.readouterr().err

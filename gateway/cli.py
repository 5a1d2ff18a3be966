"""The `loom` command: `serve` (engine + gateway), `gateway` (in front of running backends), `engine`.

    loom serve --model smollm2 --port 8000
    loom gateway --backend http://gpu1:30000 --backend http://gpu2:30000 --model smollm2 --port 8000
    loom engine --model tiny --port 30000            # same flags as python -m backend.engine.server

`serve` starts the embedded engine as a child process on `--engine-port`, waits for its /health, then
runs the gateway in this process; stopping the gateway (Ctrl-C, SIGTERM) stops the engine too.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from gateway.app import GatewayConfig, create_app

DEFAULTS = GatewayConfig(backends=("http://127.0.0.1:30000",))


def _gateway_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a .gguf / tokenizer folder")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    parser.add_argument("--accept-any-model", action="store_true", help="serve every requested model name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="gateway port")
    parser.add_argument("--max-output-tokens", type=int, default=DEFAULTS.max_output_tokens)
    parser.add_argument(
        "--tool-format", default=DEFAULTS.tool_format, choices=("hermes", "qwen3-coder", "none")
    )
    parser.add_argument(
        "--api-key", action="append", default=[], help="accepted key (repeatable); default none"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: a serving gateway for coding agents.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="embedded engine + gateway")
    _gateway_flags(serve)
    serve.add_argument("--engine-port", type=int, default=30000)
    serve.add_argument("--eviction-policy", default="penelope")
    serve.add_argument("--kv-cache-tokens", type=int, default=65536)
    gateway = commands.add_parser("gateway", help="the gateway in front of running engines or SGLang servers")
    _gateway_flags(gateway)
    gateway.add_argument("--backend", action="append", required=True, help="backend base URL (repeatable)")
    commands.add_parser(
        "engine", help="the engine server (flags as python -m backend.engine.server)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        from backend.engine.launch import main as engine_main

        engine_main(argv[1:])
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve(args, parser)
    else:
        _run_gateway(args, parser, tuple(args.backend))


def _config(
    args: argparse.Namespace, backends: tuple[str, ...], parser: argparse.ArgumentParser
) -> GatewayConfig:
    try:
        return GatewayConfig(
            backends=backends,
            served_model=args.served_model_name or args.model,
            accept_any_model=args.accept_any_model,
            tool_format=args.tool_format,
            max_output_tokens=args.max_output_tokens,
            api_keys=tuple(args.api_key),
        )
    except ValueError as exc:
        parser.error(str(exc))


def _run_gateway(
    args: argparse.Namespace, parser: argparse.ArgumentParser, backends: tuple[str, ...]
) -> None:
    import uvicorn

    from tokenizer import load_tokenizer

    config = _config(args, backends, parser)
    tokenizer = load_tokenizer("smollm2" if args.model == "tiny" else args.model)
    _print_instructions(args.host, args.port, config.served_model)
    uvicorn.run(create_app(config, tokenizer), host=args.host, port=args.port, log_level="warning")


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    engine_url = f"http://127.0.0.1:{args.engine_port}"
    command = [
        sys.executable, "-m", "backend.engine.server", "--model", args.model, "--port", str(args.engine_port),
        "--eviction-policy", args.eviction_policy, "--kv-cache-tokens", str(args.kv_cache_tokens),
    ]  # fmt: skip
    engine = subprocess.Popen(command)
    try:
        _wait_healthy(engine, engine_url)
        _run_gateway(args, parser, (engine_url,))
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(timeout=10)
        except subprocess.TimeoutExpired:
            engine.kill()


def _wait_healthy(engine: subprocess.Popen[bytes], url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    print(f"loom: starting the engine at {url} ...", file=sys.stderr, flush=True)
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise SystemExit(f"loom: the engine exited with status {engine.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"loom: the engine did not become healthy within {timeout_s:.0f} s")


def _print_instructions(host: str, port: int, model: str) -> None:
    url = f"http://{host}:{port}"
    print(
        f"""
Loom gateway on {url}, serving the model "{model}".

Claude Code:
    ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY=loom ANTHROPIC_MODEL={model} claude

Codex (~/.codex/config.toml):
    model = "{model}"
    model_provider = "loom"
    [model_providers.loom]
    name = "Loom"
    base_url = "{url}/v1"
    wire_api = "responses"
    env_key = "LOOM_API_KEY"      # any value: export LOOM_API_KEY=loom

OpenAI-compatible clients: base URL {url}/v1, model "{model}".
Per-session cache statistics: {url}/v1/loom/sessions   Metrics: {url}/metrics
""",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

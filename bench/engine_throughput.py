"""Prefill and decode throughput of the engine next to HuggingFace transformers, same model and threads.

    python -m bench.engine_throughput --model smollm2 --lengths 512,2048 --decode-tokens 32

Both sides run the same weights (ours are copied into a `transformers.LlamaForCausalLM`), in float32,
with `--threads` torch threads, batch size 1:

- prefill: time to the first token of a `length`-token prompt from an empty cache. Engine: one
  request with one output token; transformers: `model(ids, use_cache=True, logits_to_keep=1)`.
- decode: per-token time of `--decode-tokens` greedy steps after that prefill. Engine: (finish - first
  token) / (tokens - 1); transformers: a loop feeding one token with its DynamicCache.

Each number is the best of `--repeats` runs. Prints a table and, as the last line, JSON with tokens/s
for both and the ratios (engine time / transformers time: above 1 means the engine is slower).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from backend.engine.engine import Engine, EngineConfig, Request
from backend.engine.launch import load_model
from backend.engine.model import Transformer
from backend.engine.sampling import SamplingParams

_HF_NAMES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def huggingface_twin(model: Transformer) -> Any:
    """A transformers LlamaForCausalLM holding the same weights (SDPA attention)."""
    import transformers

    c = model.config
    settings: dict[str, Any] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_q_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attn_implementation": "sdpa",
    }
    hf_config = transformers.LlamaConfig(**settings)
    state = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            state[f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}.weight"] = tensor
        elif parts[0] == "embed":
            state["model.embed_tokens.weight"] = tensor
        elif parts[0] == "norm":
            state["model.norm.weight"] = tensor
    hf: Any = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf.eval()


def engine_times(model: Transformer, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    capacity = -(-(len(prompt) + decode_tokens) // 16) * 16 + 64
    engine = Engine(model, EngineConfig(kv_cache_tokens=capacity, page_size=16, max_batch_tokens=8192))
    params = SamplingParams(max_new_tokens=decode_tokens, temperature=0, ignore_eos=True)
    request = Request("bench", prompt, params, arrival_s=time.perf_counter())
    engine.generate([request])
    assert request.first_token_s is not None and request.finish_s is not None
    prefill = request.first_token_s - request.arrival_s
    return prefill, (request.finish_s - request.first_token_s) / max(decode_tokens - 1, 1)


@torch.inference_mode()
def huggingface_times(hf: Any, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    import transformers

    ids = torch.tensor([prompt])
    cache = transformers.DynamicCache()
    started = time.perf_counter()
    out = hf(ids, cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - started
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    started = time.perf_counter()
    for _ in range(decode_tokens - 1):
        out = hf(token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, (time.perf_counter() - started) / max(decode_tokens - 1, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = load_model(args.model)[0]
    hf = huggingface_twin(model)
    rows = []
    for length in args.lengths:
        prompt = torch.randint(
            3, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)
        )
        tokens = prompt.tolist()
        engine_runs = [engine_times(model, tokens, args.decode_tokens) for _ in range(args.repeats)]
        hf_runs = [huggingface_times(hf, tokens, args.decode_tokens) for _ in range(args.repeats)]
        ours = (min(r[0] for r in engine_runs), min(r[1] for r in engine_runs))
        theirs = (min(r[0] for r in hf_runs), min(r[1] for r in hf_runs))
        rows.append(
            {
                "prompt_tokens": length,
                "engine_prefill_tok_s": length / ours[0],
                "hf_prefill_tok_s": length / theirs[0],
                "prefill_ratio": ours[0] / theirs[0],
                "engine_decode_ms": 1000 * ours[1],
                "hf_decode_ms": 1000 * theirs[1],
                "decode_ratio": ours[1] / theirs[1],
            }
        )
    return {"model": args.model, "threads": args.threads, "decode_tokens": args.decode_tokens, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a .gguf path")
    parser.add_argument("--lengths", default="512,2048", help="comma-separated prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.decode_tokens < 2 or args.repeats < 1 or args.threads < 1 or min(args.lengths) < 1:
        parser.error("--decode-tokens must be >= 2, --repeats, --threads and lengths >= 1")
    report = run(args)
    print(f"{args.model}, {args.threads} threads, float32, batch 1 (ratio = engine / transformers time)")
    print(
        f"{'prompt':>7} {'engine tok/s':>13} {'hf tok/s':>9} {'ratio':>6} "
        f"{'engine ms/tok':>14} {'hf ms/tok':>10} {'ratio':>6}"
    )
    for row in report["rows"]:
        print(
            f"{row['prompt_tokens']:>7} {row['engine_prefill_tok_s']:>13.0f} {row['hf_prefill_tok_s']:>9.0f} "
            f"{row['prefill_ratio']:>6.2f} {row['engine_decode_ms']:>14.1f} {row['hf_decode_ms']:>10.1f} "
            f"{row['decode_ratio']:>6.2f}"
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

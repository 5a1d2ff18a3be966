"""GPU check of the engine, for a machine with CUDA: `python -m bench.gpu_check` (about a minute).

1. SmolLM2-135M-Instruct in bfloat16 on the GPU answers the France prompt of model.md §6.
2. Phantom restore on the GPU: sessions on a small cache (holes recomputed in the same batch as new
   tokens) give the same greedy tokens as on a cache that never evicts, with the tiny model in float32,
   in the fast and in the deterministic mode.
Prints one JSON line; exits 1 if a check fails. On a machine without CUDA it checks the CPU path.
"""

from __future__ import annotations

import json
import sys

import torch

from backend.engine.engine import Engine, EngineConfig, Request
from backend.engine.launch import load_model, pick_device
from backend.engine.model import Transformer
from backend.engine.sampling import SamplingParams

FRANCE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def sessions(engine: Engine, seed: int) -> list[list[int]]:
    """Three sessions, four turns each, every prompt resending history + reply + 16 new tokens."""
    generator = torch.Generator().manual_seed(seed)
    history = {s: torch.randint(3, 512, (48 + 8 * s,), generator=generator).tolist() for s in range(3)}
    outputs = []
    for turn in range(4):
        for s in range(3):
            params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
            request = engine.generate([Request(f"{s}/{turn}", history[s], params)])[0]
            outputs.append(request.output_ids)
            history[s] += request.output_ids + torch.randint(3, 512, (16,), generator=generator).tolist()
    return outputs


def phantom_restore_holds(tiny: Transformer, deterministic: bool) -> tuple[bool, int]:
    def engine(kv_cache_tokens: int) -> Engine:
        config = EngineConfig(
            kv_cache_tokens=kv_cache_tokens, page_size=4, max_batch_tokens=64, deterministic=deterministic
        )
        return Engine(tiny, config)

    small = engine(320)
    same = sessions(engine(8192), seed=0) == sessions(small, seed=0)
    return same, small.metrics.recomputed_hole_tokens


def main() -> int:
    device, dtype = pick_device("auto")
    model, codec, _, _ = load_model("smollm2")
    engine = Engine(model.to(device=device, dtype=dtype), EngineConfig(kv_cache_tokens=1024, page_size=16))
    france = Request("france", codec.encode(FRANCE), SamplingParams(max_new_tokens=20, temperature=0))
    engine.generate([france])
    answer = codec.decode(france.output_ids)
    results: dict[str, object] = {"device": str(device), "dtype": str(dtype), "answer": answer}
    checks = [answer == "The capital of France is Paris."]
    tiny = load_model("tiny")[0].to(device=device)
    for deterministic in (False, True):
        same, holes = phantom_restore_holds(tiny, deterministic)
        mode = "deterministic" if deterministic else "fast"
        results[f"phantom_restore_{mode}"], results[f"hole_tokens_{mode}"] = same, holes
        checks += [same, holes > 0]
    results["ok"] = all(checks)
    print(json.dumps(results))
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())

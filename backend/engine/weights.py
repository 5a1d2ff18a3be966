"""Model weights: load a llama GGUF file into a float32 state dict, or make seeded random ones.

The state dict uses the engine's names, each matrix in HF orientation ``[out_features, in_features]``
(``nq = num_q_heads``, ``nkv = num_kv_heads``, ``hd = head_dim``, ``H = hidden``, ``F = intermediate``,
``V = vocab``):

    embed.weight                 (V, H)        token_embd.weight
    norm.weight                  (H,)          output_norm.weight
    lm_head.weight               (V, H)        output.weight; absent when tie_word_embeddings
    layers.{i}.attn_norm.weight  (H,)          blk.{i}.attn_norm.weight
    layers.{i}.q_proj.weight     (nq*hd, H)    blk.{i}.attn_q.weight       rows unpermuted (below)
    layers.{i}.k_proj.weight     (nkv*hd, H)   blk.{i}.attn_k.weight       rows unpermuted (below)
    layers.{i}.v_proj.weight     (nkv*hd, H)   blk.{i}.attn_v.weight
    layers.{i}.o_proj.weight     (H, nq*hd)    blk.{i}.attn_output.weight
    layers.{i}.mlp_norm.weight   (H,)          blk.{i}.ffn_norm.weight
    layers.{i}.gate_proj.weight  (F, H)        blk.{i}.ffn_gate.weight
    layers.{i}.up_proj.weight    (F, H)        blk.{i}.ffn_up.weight
    layers.{i}.down_proj.weight  (H, F)        blk.{i}.ffn_down.weight

`load_gguf(path)` parses the file once with ``gguf.GGUFReader`` (~2.5-4.5 s: it walks the tokenizer
metadata in Python), builds a `ModelConfig` from the ``llama.*`` keys, then per tensor (~2.6 s in all):

1. dequantizes it to float32 with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16, F32, ...);
2. reshapes it to the reversed GGUF shape: GGUF lists dimensions fastest-first (``ne0`` = columns);
3. for ``attn_q`` / ``attn_k``, undoes llama.cpp's convert-time row permutation. HF Llama rotates the
   two halves of each head (rotate_half); llama.cpp's RoPE rotates adjacent pairs, so its converter
   interleaved each head's rows: ``w.reshape(n, 2, hd/2, H).swapaxes(1, 2)``. The inverse is
   ``w.reshape(n, hd/2, 2, H).swapaxes(1, 2).reshape(n*hd, H)`` with n = q heads or kv heads;
4. wraps the array as a torch tensor, copying only the F32 ones: those are views of the reader's
   read-only memory map, while dequantized arrays are fresh (copying them all cost ~2.3 s here).

Unknown tensor names, missing tensors and shapes that disagree with the config raise ValueError.

`random_weights(config, seed)` gives the same names and shapes, initialised like HF Llama (normal,
std 0.02, for the embedding and every linear; ones for the RMSNorm weights) from a seeded
``torch.Generator``, so the same seed always gives the same tensors.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend.engine.config import ModelConfig

__all__ = ["load_gguf", "random_weights", "weight_shapes"]

INIT_STD = 0.02  # HF LlamaConfig.initializer_range

# GGUF per-layer tensor -> our per-layer name
_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig)}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a model with this config and its shape, in a fixed order."""
    hidden, ffn, q, kv = config.hidden_size, config.intermediate_size, config.num_q_heads, config.num_kv_heads
    q_rows, kv_rows = q * config.head_dim, kv * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (config.vocab_size, hidden),
        "norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        shapes |= {
            f"layers.{i}.attn_norm.weight": (hidden,),
            f"layers.{i}.q_proj.weight": (q_rows, hidden),
            f"layers.{i}.k_proj.weight": (kv_rows, hidden),
            f"layers.{i}.v_proj.weight": (kv_rows, hidden),
            f"layers.{i}.o_proj.weight": (hidden, q_rows),
            f"layers.{i}.mlp_norm.weight": (hidden,),
            f"layers.{i}.gate_proj.weight": (ffn, hidden),
            f"layers.{i}.up_proj.weight": (ffn, hidden),
            f"layers.{i}.down_proj.weight": (hidden, ffn),
        }
    return shapes


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights like HF Llama's init: N(0, 0.02) matrices, ones for the norms."""
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            weights[name] = torch.empty(shape, dtype=torch.float32).normal_(
                0.0, INIT_STD, generator=generator
            )
    return weights


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and dequantized float32 state dict (our names) of a llama-architecture GGUF file."""
    import gguf  # deferred: only GGUF loading needs it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config_from_fields(reader.fields, tie=("output.weight" not in tensors), path=path)
    expected = weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for gguf_name, tensor in tensors.items():
        name = _our_name(gguf_name, path)
        if name not in expected:
            raise ValueError(f"GGUF tensor {gguf_name!r} in {str(path)!r} does not fit the config {config}")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith(".q_proj.weight"):
            array = _unpermute(array, config.num_q_heads)
        elif name.endswith(".k_proj.weight"):
            array = _unpermute(array, config.num_kv_heads)
        if array.shape != expected[name]:
            raise ValueError(
                f"GGUF tensor {gguf_name!r} in {str(path)!r} has shape {array.shape}, not {expected[name]}"
            )
        array = np.asarray(array, dtype=np.float32)
        # Dequantized arrays are fresh; F32 ones are views of the read-only memory map and need a copy.
        weights[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    if missing := [name for name in expected if name not in weights]:
        raise ValueError(f"GGUF file {str(path)!r} lacks tensors for {missing[:5]} ({len(missing)} missing)")
    return config, {name: weights[name] for name in expected}


def _unpermute(w: np.ndarray[Any, Any], n_heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's per-head row interleave of q/k (module docstring, step 3)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _our_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r} in {str(path)!r}")
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def _config_from_fields(fields: dict[str, Any], tie: bool, path: Path) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is None:
            raise ValueError(f"GGUF file {str(path)!r} has no {key!r} metadata")
        return default

    if (arch := get("general.architecture")) != "llama":
        raise ValueError(f"GGUF architecture {arch!r} in {str(path)!r} is not supported (only 'llama')")
    if get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"GGUF file {str(path)!r} uses RoPE scaling, which the engine does not support")
    hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
    head_dim = int(get("llama.attention.key_length", hidden // heads))
    if int(get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF file {str(path)!r} uses partial RoPE, which the engine does not support")
    vocab = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else None
    return ModelConfig(
        vocab_size=int(get("llama.vocab_size", vocab)),
        hidden_size=hidden,
        intermediate_size=int(get("llama.feed_forward_length")),
        num_layers=int(get("llama.block_count")),
        num_q_heads=heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("llama.rope.freq_base", _DEFAULTS["rope_theta"])),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("llama.context_length")),
        tie_word_embeddings=tie,
        bos_token_id=int(get("tokenizer.ggml.bos_token_id", _DEFAULTS["bos_token_id"])),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id", _DEFAULTS["eos_token_id"])),
        name=str(get("general.name", path.stem)),
    )

"""Weights: GGUF loading (config, names, shapes, q/k unpermute) and seeded random weights.

The real SmolLM2 GGUF is loaded once per module (~6-8 s); a transformers `LlamaForCausalLM` built from
our tensors must answer the France question exactly like the reference (model.md §6), which fails if
the unpermute or the name mapping is wrong. Tiny GGUF files written with `gguf.GGUFWriter` cover the
round trip and the error paths without the real model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend.engine.config import ModelConfig, tiny_config
from backend.engine.weights import _unpermute, load_gguf, random_weights, weight_shapes
from tokenizer import smollm2_gguf_path

# The chat-template prompt of model.md §5 ("What is the capital of France? Answer in one sentence.",
# default system prompt, generation prompt), as SmolLM2 token ids.
FRANCE_PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
    8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198,
    1, 520, 9531, 198,
]  # fmt: skip
# "The capital of France is Paris." followed by <|im_end|>.
PARIS_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]

# our per-layer name -> HF LlamaDecoderLayer name
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """NOTE: 2-thread torch slows down 5-15x when another process holds a core (model.md §13)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_gguf(smollm2_gguf_path())


def to_hf(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = {"model.embed_tokens.weight": weights["embed.weight"], "model.norm.weight": weights["norm.weight"]}
    if "lm_head.weight" in weights:
        hf["lm_head.weight"] = weights["lm_head.weight"]
    for name, tensor in weights.items():
        if match := re.fullmatch(r"layers\.(\d+)\.(\w+)\.weight", name):
            hf[f"model.layers.{match[1]}.{HF_LAYER_NAMES[match[2]]}.weight"] = tensor
    return hf


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation (HF layout -> GGUF layout)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], extra: str = "") -> None:
    """A tiny llama GGUF (F32 tensors, GGUF names, q/k permuted like llama.cpp) of these weights."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(config.name)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_q_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    ours_to_gguf = {
        "attn_norm": "attn_norm",
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "mlp_norm": "ffn_norm",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
    }
    top = {
        "embed.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name, tensor in weights.items():
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = llama_permute(array, config.num_q_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_permute(array, config.num_kv_heads)
        if name in top:
            gguf_name = top[name]
        else:
            _, layer, kind, _ = name.split(".")
            gguf_name = f"blk.{layer}.{ours_to_gguf[kind]}.weight"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    if extra:
        writer.add_tensor(extra, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the real SmolLM2 GGUF ---------------------------------------------------------------------------


def test_smollm2_config(smollm2: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """The config read from the GGUF metadata matches SmolLM2-135M (model.md §4)."""
    config, _ = smollm2
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_q_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert config.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"


def test_smollm2_names_and_shapes(smollm2: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """Every expected tensor is present, float32, with its HF-orientation shape; no lm_head (tied)."""
    config, weights = smollm2
    assert {name: tuple(t.shape) for name, t in weights.items()} == weight_shapes(config)
    assert len(weights) == 2 + 9 * 30
    assert "lm_head.weight" not in weights
    assert weights["layers.0.q_proj.weight"].shape == (576, 576)
    assert weights["layers.0.k_proj.weight"].shape == (192, 576)
    assert weights["layers.0.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in weights.values())


def test_smollm2_greedy_matches_reference(smollm2: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """transformers' Llama built from our tensors answers "The capital of France is Paris." (greedy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config, weights = smollm2
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    with torch.device("meta"):  # skips the ~3 s random init
        model = LlamaForCausalLM(hf_config)
    model.eval()  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(to_hf(weights), strict=False, assign=True)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(
        config=hf_config
    )  # inv_freq is not in the state dict
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = list(FRANCE_PROMPT)
    with torch.inference_mode(), one_thread():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == config.eos_token_id:
                break
    assert ids[len(FRANCE_PROMPT) :] == PARIS_ANSWER


# --- hermetic: tiny GGUF files and random weights ----------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """_unpermute undoes llama.cpp's per-head row interleave exactly."""
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    assert np.array_equal(_unpermute(llama_permute(w, 6), 6), w)
    assert not np.array_equal(llama_permute(w, 6), w)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gguf_round_trip(tmp_path: Path, tie: bool) -> None:
    """Weights written as a llama.cpp-style GGUF load back bit-identical, with the same config."""
    config = dataclasses.replace(
        tiny_config(num_layers=2, hidden_size=64, vocab_size=300), tie_word_embeddings=tie
    )
    weights = random_weights(config, seed=7)
    write_gguf(tmp_path / "tiny.gguf", config, weights)
    loaded_config, loaded = load_gguf(tmp_path / "tiny.gguf")
    assert loaded_config.num_layers == 2 and loaded_config.num_kv_heads == config.num_kv_heads
    assert loaded_config.tie_word_embeddings == tie
    assert loaded_config.rope_theta == config.rope_theta
    assert list(loaded) == list(weight_shapes(config))
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


def test_gguf_unknown_tensor(tmp_path: Path) -> None:
    config = tiny_config(num_layers=1, hidden_size=32, vocab_size=100)
    write_gguf(tmp_path / "x.gguf", config, random_weights(config, 0), extra="blk.0.attn_q_norm.weight")
    with pytest.raises(ValueError, match=re.escape("unknown GGUF tensor 'blk.0.attn_q_norm.weight'")):
        load_gguf(tmp_path / "x.gguf")


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    config = tiny_config(num_layers=1, hidden_size=32, vocab_size=100)
    weights = random_weights(config, 0)
    del weights["layers.0.up_proj.weight"]
    write_gguf(tmp_path / "x.gguf", config, weights)
    with pytest.raises(ValueError, match=r"lacks tensors for \['layers.0.up_proj.weight'\]"):
        load_gguf(tmp_path / "x.gguf")


def test_gguf_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.gguf"))):
        load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError):
        load_gguf(tmp_path / "junk.gguf")


def test_random_weights_shapes_and_init() -> None:
    """Names and shapes follow weight_shapes; norms are ones, matrices ~ N(0, 0.02), float32."""
    config = tiny_config(num_layers=2, hidden_size=64)
    weights = random_weights(config, seed=0)
    assert {name: tuple(t.shape) for name, t in weights.items()} == weight_shapes(config)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert torch.equal(weights["norm.weight"], torch.ones(64))
    embed = weights["embed.weight"]
    assert abs(embed.mean().item()) < 1e-3 and embed.std().item() == pytest.approx(0.02, rel=0.01)


def test_random_weights_seed_reproducibility() -> None:
    """Same seed must produce identical weights; another seed different ones."""
    config = tiny_config(num_layers=1, hidden_size=32)
    a, b, c = random_weights(config, 3), random_weights(config, 3), random_weights(config, 4)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["layers.0.q_proj.weight"], c["layers.0.q_proj.weight"])

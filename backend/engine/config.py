"""Configuration of the embedded engine: the model's shape and the engine's knobs, frozen and validated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama/Qwen-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_q_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


def tiny_config(num_layers: int = 2, hidden_size: int = 64, vocab_size: int = 49152) -> ModelConfig:
    """A tiny random-weight model with SmolLM2's vocabulary, for tests and long-context benchmarks:
    heads = hidden / 16 (head_dim 16), kv heads = heads / 2, FFN = 2 * hidden, 131,072 positions."""
    heads = max(2, hidden_size // 16)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_q_heads=heads,
        num_kv_heads=heads // 2,
        head_dim=hidden_size // heads,
        rope_theta=100000.0,
        max_position_embeddings=131072,
        name=f"tiny-L{num_layers}-H{hidden_size}",
    )

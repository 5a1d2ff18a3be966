"""Tokenizers for the gateway and the engine: loading (GGUF, tokenizer.json, exported folders)."""

from tokenizer.loader import load_tokenizer, smollm2_gguf_path

__all__ = ["load_tokenizer", "smollm2_gguf_path"]

"""A Llama/Qwen-style decoder in plain PyTorch that reads and writes a paged KV pool.

    x = embed(ids)
    per layer:  h = x + o_proj(attend(rope(q_proj(n)), write_then_read(rope(k_proj(n)), v_proj(n))))
                x = h + down_proj(silu(gate_proj(m)) * up_proj(m))      n = rms(x), m = rms(h)
    logits = lm_head(rms(x))   (only at the rows asked for)

One forward call runs a *ragged batch*: the tokens of several sequences flattened into one row each,
with their absolute positions and the KV slot each row writes. A sequence's rows need not be contiguous
positions: a request restoring a hole brings the hole's tokens (a phantom segment, at their original
positions) and its own new tokens in the same call. In every layer the whole batch writes its K/V into
the pool first, then each sequence attends over the slots of its positions 0..max: so a row at position p
reads the refilled hole, the cached prefix before it and the kept history after the hole (keys at
positions > p are masked). Grouped-query attention repeats each KV head for its query heads.

Attention uses `scaled_dot_product_attention` per sequence and block of query rows, each block against
the keys up to its last position only (one query row: no mask; several: a boolean mask
`key_position <= query_position`), so a row at position p costs about p, as the cost model assumes.
Rows of a sequence come in increasing position order.

`deterministic=True` swaps in `_fixed_order_attention` and fixed-size row tiles for every matmul, so
that a token's K/V, hidden states and logits are bit-identical whatever else shares its batch and however
long its context buffer is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from backend.engine.config import ModelConfig

# Rows per matmul tile and keys per block in deterministic mode: fixed shapes give fixed kernels.
TILE_ROWS = 16
KEY_BLOCK = 64
# Query rows per attention call in the fast path: bounds the mask and skips keys past the block.
QUERY_BLOCK = 256


@dataclass(slots=True)
class SequenceView:
    """One sequence of a ragged batch: its rows `[row_start, row_end)` and where its context lives."""

    row_start: int
    row_end: int
    context_pages: torch.Tensor
    """(ceil(L / page_size),) int64 pool pages holding positions 0..L-1 in order."""
    context_len: int
    """L = 1 + the largest position among its rows."""


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    write_slots: torch.Tensor  # (T,) int64 pool slot each row's K/V goes to
    sequences: list[SequenceView]
    logit_rows: torch.Tensor  # (R,) int64 rows whose logits are returned
    page_size: int = 1  # slots per pool page: contexts are gathered a page at a time


class KVBuffers:
    """The device KV pool: per layer K and V of shape (num_slots, num_kv_heads, head_dim)."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        # Zeros, never garbage: deterministic attention multiplies masked slots by exactly 0.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class Rotary:
    """RoPE tables in float32 (rounding them to bf16 shifts logits noticeably), grown on demand."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim) rotated at `positions` (T,), half-split layout as in HF Llama."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0] or self.cos.device != positions.device:
            grown = max(needed, 2 * self.cos.shape[0], 1024)
            angles = torch.outer(torch.arange(grown, dtype=torch.float32), self.inv_freq)
            table = torch.cat([angles, angles], dim=-1)
            self.cos, self.sin = table.cos().to(positions.device), table.sin().to(positions.device)
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, head_dim)
        sin = self.sin[positions].unsqueeze(1)
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """x @ weight.T; in deterministic mode in zero-padded tiles of TILE_ROWS rows (one kernel shape)."""
    if not deterministic:
        return F.linear(x, weight)
    rows = x.shape[0]
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    tiles = [F.linear(tile, weight) for tile in torch.split(x, TILE_ROWS)]
    return torch.cat(tiles)[:rows]


class Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, q_dim = config.hidden_size, config.num_q_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.attn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.num_q_heads, self.num_kv_heads = config.num_q_heads, config.num_kv_heads
        self.head_dim = config.head_dim

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        rotary: Rotary,
        deterministic: bool,
    ) -> torch.Tensor:
        rows = x.shape[0]
        n = self.attn_norm(x)
        q = _linear(n, self.q_proj.weight, deterministic).view(rows, self.num_q_heads, self.head_dim)
        k = _linear(n, self.k_proj.weight, deterministic).view(rows, self.num_kv_heads, self.head_dim)
        v = _linear(n, self.v_proj.weight, deterministic).view(rows, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, batch.positions), rotary.apply(k, batch.positions)
        # Write first (the whole batch, phantom rows included), then read.
        k_pool[batch.write_slots] = k.to(k_pool.dtype)
        v_pool[batch.write_slots] = v.to(v_pool.dtype)
        attended = torch.empty_like(q)
        for seq in batch.sequences:
            rows_q = q[seq.row_start : seq.row_end]
            keys = _gather(k_pool, seq, batch.page_size)
            values = _gather(v_pool, seq, batch.page_size)
            query_positions = batch.positions[seq.row_start : seq.row_end]
            attend = _fixed_order_attention if deterministic else _sdpa_attention
            attended[seq.row_start : seq.row_end] = attend(rows_q, keys, values, query_positions)
        h = x + _linear(attended.reshape(rows, -1), self.o_proj.weight, deterministic)
        m = self.mlp_norm(h)
        gate = _linear(m, self.gate_proj.weight, deterministic)
        up = _linear(m, self.up_proj.weight, deterministic)
        return h + _linear(F.silu(gate) * up, self.down_proj.weight, deterministic)


def _gather(pool: torch.Tensor, seq: SequenceView, page_size: int) -> torch.Tensor:
    """(L, kv_heads, d): the sequence's context, copied whole pages at a time (few, large copies)."""
    pages = pool.view(-1, page_size, *pool.shape[1:])[seq.context_pages]
    return pages.reshape(-1, *pool.shape[1:])[: seq.context_len]


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(L, kv_heads, d) -> (heads, L, d), each KV head repeated for its query heads."""
    return t.transpose(0, 1).repeat_interleave(groups, dim=0)


def _sdpa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """q: (Q, heads, d) at increasing positions; keys/values: (L, kv_heads, d) for positions 0..L-1.

    Queries go in blocks of QUERY_BLOCK rows, each against only the keys up to its last position, so
    attention costs what the cost model says (a row at position p reads p keys): recomputing a hole at
    the front of a long history is cheap even though the same batch also reads the whole context.
    """
    num_kv, groups = keys.shape[1], q.shape[1] // keys.shape[1]
    k_all, v_all = keys.transpose(0, 1), values.transpose(0, 1)  # (kv_heads, L, d)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], QUERY_BLOCK):
        block_positions = query_positions[start : start + QUERY_BLOCK]
        rows, length = block_positions.shape[0], int(block_positions[-1]) + 1
        mask = None
        if rows > 1 or int(block_positions[0]) != length - 1:
            keys_at = torch.arange(length, device=q.device)
            mask = (keys_at.unsqueeze(0) <= block_positions.unsqueeze(1)).repeat(groups, 1)  # (g*B, length)
        # Fold each KV head's query heads into the query dimension: (kv_heads, groups * B, d). One KV
        # head then serves all its queries in one call, with no repeated K/V (3x faster decode here).
        block = q[start : start + QUERY_BLOCK].transpose(0, 1).reshape(num_kv, groups * rows, -1)
        attended = F.scaled_dot_product_attention(block, k_all[:, :length], v_all[:, :length], attn_mask=mask)
        out[start : start + QUERY_BLOCK] = attended.reshape(q.shape[1], rows, -1).transpose(0, 1)
    return out


def _fixed_order_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """Attention whose per-row result is independent of the other rows and of the context length.

    Queries go in zero-padded tiles of TILE_ROWS, keys in blocks of KEY_BLOCK from position 0, with an
    online softmax in float32 accumulated block by block in that fixed order. Every matmul has one of
    two fixed shapes, masked keys get probability exactly 0, and blocks past a tile's last position are
    skipped, so a row sees the same arithmetic whatever its neighbours and buffer length are.
    """
    num_q, heads, d = q.shape
    groups = heads // keys.shape[1]
    scale = d**-0.5
    out = torch.empty(num_q, heads, d, dtype=q.dtype, device=q.device)
    padded_len = -(-keys.shape[0] // KEY_BLOCK) * KEY_BLOCK
    k_all = _pad_rows(_expand_kv(keys, groups).float(), padded_len, dim=1)  # (heads, Lp, d)
    v_all = _pad_rows(_expand_kv(values, groups).float(), padded_len, dim=1)
    for start in range(0, num_q, TILE_ROWS):
        tile_positions = query_positions[start : start + TILE_ROWS]
        tile = _pad_rows(q[start : start + TILE_ROWS].float().transpose(0, 1), TILE_ROWS, dim=1)  # (h, T, d)
        positions = _pad_rows(tile_positions, TILE_ROWS, dim=0, value=-1)
        running_max = torch.full((heads, TILE_ROWS, 1), float("-inf"), device=q.device)
        denominator = torch.zeros(heads, TILE_ROWS, 1, device=q.device)
        numerator = torch.zeros(heads, TILE_ROWS, d, device=q.device)
        for block in range(0, int(tile_positions.max()) + 1, KEY_BLOCK):
            k_block, v_block = k_all[:, block : block + KEY_BLOCK], v_all[:, block : block + KEY_BLOCK]
            scores = torch.matmul(tile, k_block.transpose(1, 2)) * scale  # (h, T, KEY_BLOCK)
            key_positions = torch.arange(block, block + KEY_BLOCK, device=q.device).unsqueeze(0)
            visible = (key_positions <= positions.unsqueeze(1)).unsqueeze(0)
            scores = scores.masked_fill(~visible, float("-inf"))
            new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            correction = torch.exp(running_max - safe_max)
            weights = torch.exp(scores - safe_max)
            denominator = denominator * correction + weights.sum(-1, keepdim=True)
            numerator = numerator * correction + torch.matmul(weights, v_block)
            running_max = new_max
        rows = tile_positions.shape[0]
        result = (numerator / denominator.clamp_min(1e-30))[:, :rows]
        out[start : start + rows] = result.transpose(0, 1).to(q.dtype)
    return out


def _pad_rows(t: torch.Tensor, size: int, dim: int, value: float = 0.0) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_full(pad_shape, value)], dim=dim)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVBuffers, deterministic: bool = False) -> torch.Tensor:
        """Logits (R, vocab) in float32 at `batch.logit_rows`; writes every row's K/V into `kv`."""
        x = self.embed(batch.input_ids)
        for layer, k_pool, v_pool in zip(self.layers, kv.k, kv.v, strict=True):
            x = layer(x, batch, k_pool, v_pool, self.rotary, deterministic)
        hidden = self.norm(x[batch.logit_rows])
        return _linear(hidden, self.lm_head.weight, deterministic).float()

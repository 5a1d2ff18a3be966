"""The decoder against HuggingFace's Llama, ragged batches, write-then-read, and deterministic mode."""

from __future__ import annotations

import torch

from backend.engine.config import ModelConfig, tiny_config
from backend.engine.model import ForwardBatch, KVBuffers, SequenceView, Transformer
from bench.engine_throughput import huggingface_twin

CONFIG = tiny_config(num_layers=2, hidden_size=64, vocab_size=512)


def make_model(config: ModelConfig = CONFIG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model.eval()


def prefill_batch(sequences: list[list[tuple[int, int]]], slots_per_seq: int) -> ForwardBatch:
    """Each sequence: (token, position) rows; sequence i's position p lives in slot i*slots + p."""
    ids, positions, slots, views, logit_rows = [], [], [], [], []
    for i, rows in enumerate(sequences):
        start = len(ids)
        for token, position in rows:
            ids.append(token)
            positions.append(position)
            slots.append(i * slots_per_seq + position)
        length = max(p for _, p in rows) + 1
        views.append(SequenceView(start, len(ids), torch.arange(length) + i * slots_per_seq, length))
        logit_rows.extend(range(start, len(ids)))
    return ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), views, torch.tensor(logit_rows)
    )


def test_logits_match_huggingface_llama():
    model = make_model()
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    expected = huggingface_twin(model)(tokens).logits[0]
    kv = KVBuffers(CONFIG, 64, torch.float32, torch.device("cpu"))
    ours = model(prefill_batch([[(int(t), p) for p, t in enumerate(tokens[0])]], 64), kv)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_a_hole_refilled_in_the_same_batch_as_new_tokens_gives_the_same_logits():
    """Phantom restore: positions 10-19 recomputed alongside new tokens 30-39, the rest read from cache."""
    model = make_model()
    tokens = torch.randint(0, CONFIG.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    kv = KVBuffers(CONFIG, 64, torch.float32, torch.device("cpu"))
    full = model(prefill_batch([[(t, p) for p, t in enumerate(tokens)]], 64), kv)
    for layer in range(CONFIG.num_layers):  # lose positions 10-19 and 30-39
        kv.k[layer][10:20] = 0
        kv.v[layer][10:20] = 0
    rows = [(tokens[p], p) for p in [*range(10, 20), *range(30, 40)]]
    restored = model(prefill_batch([rows], 64), kv)
    torch.testing.assert_close(restored[10:], full[30:], atol=1e-5, rtol=1e-5)


def test_ragged_batch_rows_do_not_see_each_other():
    model = make_model()
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (12, 7))
    alone = model(
        prefill_batch([[(t, p) for p, t in enumerate(a)]], 32),
        KVBuffers(CONFIG, 64, torch.float32, torch.device("cpu")),
    )
    together = model(
        prefill_batch([[(t, p) for p, t in enumerate(a)], [(t, p) for p, t in enumerate(b)]], 32),
        KVBuffers(CONFIG, 64, torch.float32, torch.device("cpu")),
    )
    torch.testing.assert_close(together[:12], alone, atol=1e-5, rtol=1e-5)


def test_deterministic_mode_is_bit_identical_across_batch_compositions():
    model = make_model()
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (37, 70))
    rows_a = [(t, p) for p, t in enumerate(a)]
    kv = lambda: KVBuffers(CONFIG, 256, torch.float32, torch.device("cpu"))  # noqa: E731
    alone = model(prefill_batch([rows_a], 128), kv(), deterministic=True)
    with_neighbour = model(
        prefill_batch([[(t, p) for p, t in enumerate(b)], rows_a], 128), kv(), deterministic=True
    )
    assert torch.equal(with_neighbour[70:], alone)
    # Prefill in two chunks: the second chunk reads the first from the pool.
    pool = kv()
    model(prefill_batch([rows_a[:20]], 128), pool, deterministic=True)
    second = model(prefill_batch([rows_a[20:]], 128), pool, deterministic=True)
    assert torch.equal(second, alone[20:])
    # And it agrees with the fast path to float tolerance.
    torch.testing.assert_close(model(prefill_batch([rows_a], 128), kv()), alone, atol=1e-5, rtol=1e-5)

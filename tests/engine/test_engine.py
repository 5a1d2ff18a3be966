"""The engine: phantom restore never changes outputs, batching, abort, stops, validation."""

from __future__ import annotations

import pytest
import torch

from backend.engine.config import tiny_config
from backend.engine.engine import Engine, EngineConfig, Request
from backend.engine.model import Transformer
from backend.engine.sampling import SamplingParams
from backend.engine.weights import random_weights

CONFIG = tiny_config(num_layers=2, hidden_size=64, vocab_size=512)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.set_num_threads(1)  # predictable next to other work (model.md §13)
    transformer = Transformer(CONFIG)
    # std 0.2 rather than 0.02: a random model whose greedy outputs vary from token to token.
    weights = {name: w * 10 if w.dim() == 2 else w for name, w in random_weights(CONFIG, seed=0).items()}
    transformer.load_state_dict(weights, strict=False)
    return transformer.eval()


def greedy(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def conversations(engine: Engine, seed: int, num_sessions: int = 3, turns: int = 4) -> list[Request]:
    """Sessions that each resend their history plus the reply plus new tokens, round robin."""
    generator = torch.Generator().manual_seed(seed)
    history = {
        s: torch.randint(3, CONFIG.vocab_size, (48 + 8 * s,), generator=generator).tolist()
        for s in range(num_sessions)
    }
    served = []
    for turn in range(turns):
        for s in range(num_sessions):
            prompt = history[s]
            request = Request(
                f"{s}/{turn}", prompt, greedy(), return_logprob=True, logprob_start_len=len(prompt) - 12
            )
            engine.generate([request])
            engine.cache.check_integrity()
            served.append(request)
            new = torch.randint(3, CONFIG.vocab_size, (16,), generator=generator).tolist()
            history[s] = prompt + request.output_ids + new
    return served


def make_engine(model: Transformer, kv_cache_tokens: int, **overrides: object) -> Engine:
    settings: dict[str, object] = {"page_size": 4, "max_batch_tokens": 64} | overrides
    config = EngineConfig(kv_cache_tokens=kv_cache_tokens, **settings)  # type: ignore[arg-type]
    return Engine(model, config)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penelope_holes_restored_in_the_batch_give_the_outputs_of_a_cache_that_never_evicts(model, seed):
    reference = conversations(make_engine(model, 8192), seed)
    small = make_engine(model, 320)
    evicting = conversations(small, seed)
    assert small.metrics.recomputed_hole_tokens > 0, "the small cache must have made holes"
    assert small.metrics.evicted_tokens > 0
    for ref, got in zip(reference, evicting, strict=True):
        assert got.output_ids == ref.output_ids
        assert got.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-5)


def test_deterministic_mode_is_bit_identical_with_and_without_eviction(model):
    reference = conversations(make_engine(model, 8192, deterministic=True), seed=5)
    small = make_engine(model, 320, deterministic=True)
    evicting = conversations(small, seed=5)
    assert small.metrics.recomputed_hole_tokens > 0
    for ref, got in zip(reference, evicting, strict=True):
        assert (got.output_ids, got.prompt_logprobs, got.output_logprobs) == (
            ref.output_ids, ref.prompt_logprobs, ref.output_logprobs,
        )  # fmt: skip


def test_host_tier_loads_give_the_same_outputs(model):
    reference = conversations(make_engine(model, 8192), seed=7)
    tiered = make_engine(model, 256, host_kv_tokens=256, swap_buffer_tokens=16)
    got = conversations(tiered, seed=7)
    assert tiered.metrics.host_loaded_tokens > 0 and tiered.metrics.offloaded_tokens > 0
    for ref, request in zip(reference, got, strict=True):
        assert request.output_ids == ref.output_ids
        assert request.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-5)


@pytest.mark.parametrize("policy", ["lru", "lru-block", "leaf-head"])
def test_every_policy_keeps_outputs_unchanged(model, policy):
    reference = conversations(make_engine(model, 8192), seed=3, turns=3)
    got = conversations(make_engine(model, 320, eviction_policy=policy), seed=3, turns=3)
    assert [r.output_ids for r in got] == [r.output_ids for r in reference]


def test_concurrent_requests_match_one_at_a_time(model):
    prompts = [
        torch.randint(3, 512, (20 + 9 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(5)
    ]
    alone = [make_engine(model, 4096).generate([Request("r", p, greedy(12))])[0].output_ids for p in prompts]
    engine = make_engine(model, 4096, max_batch_tokens=32)
    together = engine.generate([Request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    assert [r.output_ids for r in together] == alone


def test_second_turn_reuses_the_first_turns_prompt_and_output(model):
    engine = make_engine(model, 4096)
    prompt = list(range(3, 43))
    first = engine.generate([Request("a", prompt, greedy(8))])[0]
    second = engine.generate([Request("b", prompt + first.output_ids + [7, 8, 9], greedy(2))])[0]
    # 40 prompt + 7 computed outputs = 47 tokens -> 11 whole pages of 4 are cached.
    assert second.cached_tokens == 44


def test_abort_of_waiting_and_running_requests_frees_everything(model):
    engine = make_engine(model, 4096, max_running_requests=1)
    running, waiting = Request("run", list(range(3, 60)), greedy(50)), Request("wait", [5, 6, 7], greedy())
    engine.add_request(running)
    engine.add_request(waiting)
    engine.step()
    assert engine.abort("wait") and engine.abort("run")
    assert not engine.abort("run")  # already finished
    assert running.finish_reason == {"type": "abort"} and not engine.has_work
    engine.cache.check_integrity()
    assert engine.cache.size_info().device_in_use_pages == 0


def test_stop_token_ids_stop_strings_and_length(model):
    engine = make_engine(model, 4096)
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    probe = engine.generate([Request("probe", prompt, greedy(12))])[0].output_ids
    cut = next(i for i in range(1, len(probe)) if probe[i] not in probe[:i])  # first new token
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(probe[cut],))
    stopped = engine.generate([Request("t", prompt, params)])[0]
    assert stopped.output_ids == probe[: cut + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": probe[cut]}
    engine.decode = lambda ids: "".join(f"<{i}>" for i in ids)
    stop = f"<{probe[cut]}>"
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop=(stop,))
    by_string = engine.generate([Request("s", prompt, params)])[0]
    assert by_string.output_ids == probe[: cut + 1]
    assert by_string.finish_reason == {"type": "stop", "matched": stop}
    assert engine.generate([Request("l", prompt, greedy(4))])[0].finish_reason == {
        "type": "length",
        "length": 4,
    }


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    runs = [
        make_engine(model, 4096).generate([Request("r", [3, 4, 5], params)])[0].output_ids for _ in range(2)
    ]
    other = SamplingParams(max_new_tokens=10, temperature=1.0, seed=12, ignore_eos=True)
    assert runs[0] == runs[1]
    assert make_engine(model, 4096).generate([Request("r", [3, 4, 5], other)])[0].output_ids != runs[0]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("x", [], greedy()), "the prompt is empty"),
        (Request("x", [1, 600], greedy()), "token ids must be in \\[0, 512\\)"),
        (Request("x", list(range(3, 300)), greedy(100)), "exceeds the KV cache \\(256 tokens\\)"),
    ],
)
def test_requests_that_can_never_run_are_refused(model, request_, message):
    with pytest.raises(ValueError, match=message):
        make_engine(model, 256).add_request(request_)


def test_duplicate_request_ids_are_refused(model):
    engine = make_engine(model, 4096)
    engine.add_request(Request("same", [3, 4], greedy()))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(Request("same", [5, 6], greedy()))


def test_lpm_admits_the_request_with_most_cached_tokens_first(model):
    engine = make_engine(model, 4096, max_running_requests=1)
    cached = list(range(3, 43))
    engine.generate([Request("warm", cached, greedy(1))])
    cold, warm = Request("cold", list(range(100, 140)), greedy(1)), Request("hot", cached + [9], greedy(1))
    engine.add_request(cold)
    engine.add_request(warm)
    engine.step()
    assert engine.running == [] and warm.finished and not cold.finished


def test_smollm2_answers_in_sensible_english_through_the_engine():
    """The real model, through our model code and engine: greedy, the answer of model.md §6."""
    from backend.engine.weights import load_gguf
    from tests.engine.test_weights import FRANCE_PROMPT, PARIS_ANSWER
    from tokenizer import smollm2_gguf_path

    config, weights = load_gguf(smollm2_gguf_path())
    smollm2 = Transformer(config)
    smollm2.load_state_dict(weights, strict=False)
    engine = Engine(smollm2.eval(), EngineConfig(kv_cache_tokens=1024, page_size=16))
    request = Request("france", list(FRANCE_PROMPT), SamplingParams(max_new_tokens=20, temperature=0))
    engine.generate([request])
    assert request.output_ids == PARIS_ANSWER  # "The capital of France is Paris.<|im_end|>"
    assert request.finish_reason == {"type": "stop", "matched": config.eos_token_id}

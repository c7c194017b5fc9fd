"""The tokenizer: the model's own, a named one, or the demo's byte-level BPE trained offline and cached."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.config import RunConfig
from toolkit.data.base import (
    _DEMO_TOKENIZER_RECIPE,
    _TOKENIZER_FILES,
    DEMO_CORPUS,
    EOS_TOKEN,
    DataError,
)
from toolkit.storage.cache import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(cfg: RunConfig) -> "PreTrainedTokenizerFast":
    """``model.tokenizer`` if set; else tokenizer files next to ``model.name_or_path``; else the demo
    byte-level BPE (trained on ``toolkit/demo/corpus.txt``, vocab = the model's ``vocab_size``,
    ``<|endoftext|>`` = id 0 as eos/bos/pad), cached under ``cache_root()/tokenizers/<key>/``.

    Checks that the tokenizer has an EOS token and fits the model's embedding (``vocab_size``)."""
    model_dir = _local_model_dir(cfg.model.name_or_path)
    vocab_size = _model_vocab_size(model_dir)
    if cfg.model.tokenizer:
        tok = _load_pretrained_tokenizer(cfg.model.tokenizer, "model.tokenizer", cfg.model.trust_remote_code)
    elif model_dir is not None and any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        tok = _load_pretrained_tokenizer(str(model_dir), "model.name_or_path", cfg.model.trust_remote_code)
    elif vocab_size is None:
        raise DataError(
            f"model.name_or_path={cfg.model.name_or_path!r} has no local config.json, so the demo "
            "tokenizer's vocab_size is unknown; set model.tokenizer to a tokenizer directory or name")
    else:
        tok = _demo_tokenizer(vocab_size)
    _check_tokenizer(tok, vocab_size, cfg)
    return tok


def _local_model_dir(name_or_path: str) -> Path | None:
    """The local directory of an HF model given as a directory or a config.json path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return None


def _model_vocab_size(model_dir: Path | None) -> int | None:
    config = model_dir / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("vocab_size")


def _load_pretrained_tokenizer(name: str, field: str, trust_remote_code: bool) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    from toolkit import remote_code
    local = Path(name).expanduser().is_dir()
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear message
        if remote_code.is_custom_code_refusal(exc):
            file = "tokenizer_config.json" if remote_code.custom_classes(Path(name), "tokenizer_config.json") \
                else "config.json"
            raise remote_code.refusal(field, name, Path(name), file) from None
        where = "a local directory" if local else "not a local directory (a hub name needs network access)"
        raise DataError(f"{field}={name!r}: could not load a tokenizer ({where}): "
                        f"{type(exc).__name__}: {exc}") from exc


def _check_tokenizer(tok: "PreTrainedTokenizerBase", vocab_size: int | None, cfg: RunConfig) -> None:
    if tok.eos_token_id is None:
        raise DataError(f"the tokenizer of {cfg.model.tokenizer or cfg.model.name_or_path!r} has no "
                        "eos_token, which separates packed documents; set one in its tokenizer_config.json")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation and padding need one; eos is the usual stand-in
    if vocab_size is not None and len(tok) > vocab_size:
        raise DataError(
            f"the tokenizer has {len(tok)} tokens but model.name_or_path={cfg.model.name_or_path!r} has "
            f"vocab_size={vocab_size}; token ids would overflow the embedding. Use the model's own "
            "tokenizer (model.tokenizer) or a model config with a larger vocab_size")


def _demo_tokenizer(vocab_size: int) -> "PreTrainedTokenizerFast":
    """The demo BPE for ``vocab_size``, trained once and cached; identical bytes on every rank."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    corpus = DEMO_CORPUS.read_bytes()
    tag = f"|{vocab_size}|{tokenizers.__version__}|{_DEMO_TOKENIZER_RECIPE}".encode()
    final = cache_root() / "tokenizers" / hashlib.sha256(corpus + tag).hexdigest()[:16]
    if not (final / "tokenizer.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        try:
            _train_demo_tokenizer(corpus.decode("utf-8"), vocab_size).save_pretrained(tmp)
            os.rename(tmp, final)  # atomic: readers see nothing or a complete directory
        except OSError:
            if not (final / "tokenizer.json").is_file():  # not a lost race with another rank
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(final, trust_remote_code=False)


def _train_demo_tokenizer(corpus: str, vocab_size: int) -> "PreTrainedTokenizerFast":
    """Byte-level BPE (GPT-2 style) on the corpus lines; deterministic for a given corpus."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes: no unknown tokens
    lines = corpus.splitlines()
    bpe.train_from_iterator(lines, trainer, length=len(lines))
    assert bpe.token_to_id(EOS_TOKEN) == 0, "the special token must be id 0 (the demo model's eos/bos/pad)"
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, unk_token=None)

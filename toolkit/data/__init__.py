"""Data: a dataset source -> tokenized, packed, DP-sharded, exactly resumable batches.

Pipeline (``prepare_data``), each stage cached on disk and keyed by everything it depends on::

    source rows --check--> documents --tokenize (map)--> ids[T_doc] + loss[T_doc] --pack (map)-->
    samples: input_ids [seq_len], labels [seq_len] (-100 = no loss), num_loss_tokens

Documents. Template ``none``: ``text_column``; every token carries loss. Template ``instruction``:
``INSTRUCTION_TEMPLATE`` around ``prompt_column``, then ``response_column``; only the response and
its EOS carry loss. Template ``chat``: a list of ``{"role", "content"}`` messages in
``messages_column``, rendered with the tokenizer's chat template when it has one (else
``CHAT_HEADERS``); only assistant turns carry loss. Every document ends with EOS. Template
``preference``: each row of ``prompt_column``, ``chosen_column``, ``rejected_column`` (all text, or
TRL's conversational form: message lists) gives two documents, prompt + chosen and prompt +
rejected, tokenized as TRL's ``DPOTrainer`` does (prompt and prompt + answer tokenized whole, the
answer starting where they stop agreeing; text answers get EOS, conversations are rendered by the
chat template, or ``CHAT_HEADERS`` with EOS after each answer); only the answers carry loss.

Packing (``data.packing``; default ``documents`` for templates instruction/chat/preference, ``concat``
for none):

- ``concat`` (Megatron / HF ``group_texts`` style). Within one ``datasets.map`` batch of documents
  (``PACK_BATCH_DOCS``), the token stream is concatenated and cut into windows of ``seq_len + 1``
  tokens with stride ``seq_len``; window ``w`` gives ``input_ids = w[:-1]`` and ``labels = w[1:]``,
  with labels set to -100 where the target token carries no loss. The batch's tail that does not
  fill a window is dropped. Attention and positions run across documents (only the EOS between
  them says a new one starts): the pretraining convention, free of padding.
- ``documents``: each document gives ``inputs = doc[:-1]``, ``labels = doc[1:]`` (no token predicts
  across a boundary); whole documents are packed into rows, best fit in decreasing length inside
  the map batch (``fit_rows``; a document that fits a row is never split), with a ``document_ids``
  column (1, 2, ... per document, 0 on the padded tail). The engines restart positions at each
  document and confine attention to it (``toolkit/adapters/attention.py``), so each document's
  logits equal those of the document run alone. A document longer than ``seq_len`` is cut into
  ``seq_len`` pieces or dropped (``data.overflow``; the count is ``PackedData.num_overflow``).
- ``pad``: the same rows with one document each (the reference ``documents`` must equal).

Preference pairs (``pack_pairs``) are packed whole: a row holds ``num_pairs`` pairs, pair ``j``
(1-based) as documents ``2j - 1`` (prompt + chosen) and ``2j`` (prompt + rejected), each attending
only to itself like any document; ``documents`` fits several pairs to a row by their total length,
``pad`` puts one pair in a row. A pair longer than ``seq_len`` in all is dropped (``data.overflow``
must be ``drop``; ``concat`` is refused), so no pair is ever split across rows, micro-batches or
ranks; ``batch_counts`` gives a global batch's ``pairs``.

Rows with no loss token at all (inside a long prompt) are dropped in every mode, so a global batch
never has zero loss tokens. The cache key holds the mode and the overflow rule.

Modules: ``sources`` (rows), ``templates`` (documents), ``tokenizer``, ``pack`` (samples and the
cached pipeline), ``batches`` (global batches and this rank's micro-batches).

Batches. ``global_batch_indices`` defines the sample order for every step from (seed, step) alone,
independent of the DP size and micro-batch size, so a run resumes exactly at any layout and any
step; ``rank_micro_batches`` cuts a global batch into this rank's micro-batches. Fetching reads the
Arrow table through numpy in one call per rank and step (no per-token Python).

Concurrency. Ranks may call ``prepare_data`` together: ``datasets`` writes its caches to a temporary
file and renames it, and the demo tokenizer is written the same way; letting rank 0 go first and
the others follow after a barrier only saves their duplicated work.
"""
from __future__ import annotations

import importlib

_LAZY_NAMES = {"CHAT_HEADERS": "base", "EOS_TOKEN": "base", "INSTRUCTION_TEMPLATE": "base", "DataError": "base",
            "PackedData": "base", "batch_counts": "batches", "count_loss_tokens": "batches",
            "eval_micro_batches": "batches", "global_batch_indices": "batches", "rank_micro_batches": "batches",
            "prepare_data": "load", "pack_tokens": "pack", "load_source": "sources", "load_tokenizer": "tokenizer"}
__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str):
    """The names above, imported on first use: a process that only tokenizes (``toolkit prepare``'s
    workers) never loads torch, which ``batches`` needs."""
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f"toolkit.data.{_LAZY_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'toolkit.data' has no attribute {name!r}")

"""Data: a dataset source -> tokenized, packed, DP-sharded, exactly resumable batches.

Pipeline (``prepare_data``), each stage cached on disk and keyed by everything it depends on::

    source rows --check--> documents --tokenize (map)--> ids[T_doc] + loss[T_doc] --pack (map)-->
    samples: input_ids [seq_len], labels [seq_len] (-100 = no loss), num_loss_tokens

Documents. Template ``none``: ``text_column``; every token carries loss. Template ``instruction``:
``INSTRUCTION_TEMPLATE`` around ``prompt_column``, then ``response_column``; only the response and
its EOS carry loss. Template ``chat``: a list of ``{"role", "content"}`` messages in
``messages_column``, rendered with the tokenizer's chat template when it has one (else
``CHAT_HEADERS``); only assistant turns carry loss. Every document ends with EOS.

Packing (Megatron / HF ``group_texts`` style). Within one ``datasets.map`` batch of documents
(``PACK_BATCH_DOCS``), the token stream is concatenated and cut into windows of ``seq_len + 1``
tokens with stride ``seq_len``; window ``w`` gives ``input_ids = w[:-1]`` and ``labels = w[1:]``,
with labels set to -100 where the target token carries no loss. The batch's tail that does not fill
a window is dropped, and windows with no loss token at all (inside a long prompt) are dropped too,
so a global batch never has zero loss tokens.

Modules: ``sources`` (rows), ``templates`` (documents), ``tokenizer``, ``pack`` (samples and the
cached pipeline), ``batches`` (global batches and this rank's micro-batches).

Attention crosses document boundaries: a sample is one causal sequence, so tokens of a document
attend to the end of the previous one; only the EOS between them tells the model that a new
document starts. This is what GPT-2/Megatron pretraining does and it costs nothing. Preventing it
would need per-sample document boundaries kept through packing (e.g. a ``position_ids`` column
restarting at 0 after each EOS, or ``cu_seqlens``) *and* a model path that honours them: a
block-diagonal causal mask (memory ``[mbs, seq_len, seq_len]``) or a varlen flash-attention kernel
fed with ``position_ids``/``cu_seqlens``; the adapters would then pass that column to the model.

Batches. ``global_batch_indices`` defines the sample order for every step from (seed, step) alone,
independent of the DP size and micro-batch size, so a run resumes exactly at any layout and any
step; ``rank_micro_batches`` cuts a global batch into this rank's micro-batches. Fetching reads the
Arrow table through numpy in one call per rank and step (no per-token Python).

Concurrency. Ranks may call ``prepare_data`` together: ``datasets`` writes its caches to a temporary
file and renames it, and the demo tokenizer is written the same way; letting rank 0 go first and
the others follow after a barrier only saves their duplicated work.
"""
from __future__ import annotations

from toolkit.data.base import (
           CHAT_HEADERS,
           EOS_TOKEN,
           INSTRUCTION_TEMPLATE,
           DataError,
           PackedData,
           cache_root,
)
from toolkit.data.batches import (
           count_loss_tokens,
           eval_micro_batches,
           global_batch_indices,
           rank_micro_batches,
)
from toolkit.data.pack import pack_tokens, prepare_data
from toolkit.data.sources import load_source
from toolkit.data.tokenizer import load_tokenizer

__all__ = ["CHAT_HEADERS", "EOS_TOKEN", "INSTRUCTION_TEMPLATE", "DataError", "PackedData", "cache_root",
           "count_loss_tokens", "eval_micro_batches", "global_batch_indices", "rank_micro_batches", "pack_tokens",
           "prepare_data", "load_source", "load_tokenizer"]

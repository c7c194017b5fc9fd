"""Preference pairs in packed rows (``data.template: preference``): reading them back as (prompt,
answer) token ids, and TRL's ``DPOTrainer`` preparing the same rows (the independent reference)."""
from __future__ import annotations

import types

import datasets
import numpy as np

from toolkit.loss import IGNORE_INDEX

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template ending each turn with the demo tokenizer's EOS (as ChatML's <|im_end|> does)."""
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think></think>{% endif %}")
"""Renders the prompt alone (generation prompt: an empty thought block) differently from the full
conversation, as Gemma's templates do: the answer starts where the two stop agreeing."""
CHATML_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
                   "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML as Qwen2's template writes it (a default system turn; a newline after each turn's end)."""


def documents_of(rows: dict) -> list[list[tuple[list[int], list[int]]]]:
    """Per packed row, (inputs, labels) of each document in ``document_ids`` order."""
    out = []
    for ids, labels, docs in zip(rows["input_ids"], rows["labels"], rows["document_ids"]):
        out.append([(ids[docs == d].tolist(), labels[docs == d].tolist()) for d in range(1, int(docs.max()) + 1)])
    return out


def split_document(inputs: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one document (inputs = doc[:-1], labels = doc[1:] with -100 on the
    prompt): the answer is the labelled tail, which must be contiguous and end the document."""
    labels = np.asarray(labels)
    first = int(np.flatnonzero(labels != IGNORE_INDEX)[0])
    assert (labels[first:] != IGNORE_INDEX).all(), "the loss is not one contiguous answer at the end"
    full = list(inputs) + [int(labels[-1])]
    return full[:first + 1], full[first + 1:]


def pairs_of(rows: dict) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) ids of every pair in the rows, row by row; checks that each row
    holds ``num_pairs`` whole pairs (documents 2j - 1 and 2j) sharing their prompt."""
    out = []
    for row, docs in enumerate(documents_of(rows)):
        assert len(docs) == 2 * int(rows["num_pairs"][row]) == int(rows["num_documents"][row]), row
        for j in range(0, len(docs), 2):
            (prompt, chosen), (prompt_r, rejected) = split_document(*docs[j]), split_document(*docs[j + 1])
            assert prompt == prompt_r, f"row {row}: pair {j // 2 + 1} has two different prompts"
            out.append((prompt, chosen, rejected))
    return out


def trl_prepared(rows: list[dict], tok) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, chosen_ids, rejected_ids) per row as TRL's ``DPOTrainer`` prepares its dataset
    (``_prepare_dataset``: EOS added to text answers, prompt and prompt + answer tokenized, split
    at their common prefix), without building a trainer: only ``_tokenizer`` and the args it reads."""
    from trl import DPOTrainer

    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    ds = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), datasets.Dataset.from_list(rows),
                                     tok, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]

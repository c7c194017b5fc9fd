"""Documents from rows (plain text, instruction, chat) as token ids with a per-token loss mask."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from toolkit.config import RunConfig
from toolkit.data.base import CHAT_HEADERS, INSTRUCTION_TEMPLATE, DataError, Segment
from toolkit.data.sources import non_text_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _document_segments(row: dict, index: int, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> list[Segment]:
    """One source row as loss-flagged text pieces ending with EOS; [] for an empty text document."""
    d = cfg.data
    if d.template == "none":
        text = _text(row, d.text_column, "data.text_column", index)
        return [(text, True), (None, True)] if text else []
    if d.template == "instruction":
        prompt = _text(row, d.prompt_column, "data.prompt_column", index)
        response = _text(row, d.response_column, "data.response_column", index)
        return [(INSTRUCTION_TEMPLATE.format(prompt=prompt), False), (response, True), (None, True)]
    messages = _messages(row.get(d.messages_column), d.messages_column, index)
    segments = _template_chat(messages, tok, index) if tok.chat_template else _fixed_chat(messages)
    if not segments or segments[-1][0] is None:
        return segments
    return segments + [(None, segments[-1][1])]  # EOS learnt only after an assistant turn


def _text(row: dict, column: str, field: str, index: int) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        raise non_text_error(field, column, index, value)
    return value


def _messages(value: Any, column: str, index: int) -> list[dict]:
    if isinstance(value, dict) and isinstance(value.get("role"), list):  # legacy Sequence({...}) layout
        value = [dict(zip(value, turn)) for turn in zip(*value.values())]
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        shown = repr(value)[:80]
        raise DataError(f"data.messages_column={column!r}: row {index} holds {type(value).__name__} "
                        f"{shown}, not a list of {{'role': str, 'content': str}} messages")
    return value


def _fixed_chat(messages: list[dict]) -> list[Segment]:
    """``CHAT_HEADERS`` format; an assistant turn ends with EOS so the model learns to stop."""
    segments: list[Segment] = []
    for m in messages:
        header = CHAT_HEADERS.get(m["role"], f"### {m['role'].capitalize()}:\n")
        if m["role"] == "assistant":
            segments += [(header, False), (m["content"], True), (None, True)]
        else:
            segments += [(header + m["content"] + "\n", False)]
    return segments


def _template_chat(messages: list[dict], tok: "PreTrainedTokenizerBase", index: int) -> list[Segment]:
    """Split the tokenizer's chat template rendering into turns: assistant turns (after their
    generation prompt) carry loss. Needs a template whose rendering of a conversation prefix is a
    prefix of the full rendering, which is what generation with it relies on too."""
    segments: list[Segment] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            head = _render(tok, messages[:k], True, index)
            segments.append((_suffix(head, done, index), False))
            done = head
        full = _render(tok, messages[:k + 1], False, index)
        segments.append((_suffix(full, done, index), message["role"] == "assistant"))
        done = full
    return [s for s in segments if s[0]]


def _render(tok: "PreTrainedTokenizerBase", messages: list[dict], generation_prompt: bool, index: int) -> str:
    if not messages:
        return ""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors name the template, not the row
        raise DataError(f"data.messages_column: the tokenizer's chat template failed on row {index}: "
                        f"{exc}") from exc


def _suffix(text: str, prefix: str, index: int) -> str:
    if not text.startswith(prefix):
        raise DataError(
            f"data.template='chat': row {index}: the tokenizer's chat template renders a conversation "
            "prefix differently from the full conversation, so assistant turns cannot be located; "
            "use a tokenizer without a chat template (fixed format) or template 'instruction'")
    return text[len(prefix):]


def tokenize_fn(cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> Callable[[dict, list[int]], dict]:
    """Batched map function: rows -> per-document ``ids`` [T_doc] and ``loss`` [T_doc] (0/1: does
    this token carry loss as a prediction target). Segments are tokenized separately so the loss
    boundary falls exactly between prompt and response, as the prompt is tokenized alone at inference."""
    eos = tok.eos_token_id

    def tokenize(batch: dict, indices: list[int]) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        docs = [_document_segments(row, i, cfg, tok) for row, i in zip(rows, indices)]
        texts = [text for doc in docs for text, _ in doc if text]
        encoded = iter(tok(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else [])
        out: dict[str, list] = {"ids": [], "loss": []}
        for doc in [d for d in docs if d]:
            ids, loss = [], []
            for text, carries_loss in doc:
                piece = [eos] if text is None else (next(encoded) if text else [])
                ids += piece
                loss += [int(carries_loss)] * len(piece)
            out["ids"].append(ids)
            out["loss"].append(loss)
        return out

    return tokenize

"""Documents from rows (plain text, instruction, chat, preference pairs) as token ids with a per-token
loss mask."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from toolkit.config import RunConfig
from toolkit.data.base import CHAT_HEADERS, INSTRUCTION_TEMPLATE, DataError, Segment
from toolkit.data.sources import non_text_error, shown_value

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


def _messages(value: Any, column: str, index: int, field: str = "data.messages_column") -> list[dict]:
    if isinstance(value, dict) and isinstance(value.get("role"), list):  # legacy Sequence({...}) layout
        value = [dict(zip(value, turn)) for turn in zip(*value.values())]
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        shown = repr(value)[:80]
        raise DataError(f"{field}={column!r}: row {index} holds {type(value).__name__} "
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


def _render(tok: "PreTrainedTokenizerBase", messages: list[dict], generation_prompt: bool, index: int,
            field: str = "data.messages_column") -> str:
    if not messages:
        return ""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors name the template, not the row
        raise DataError(f"{field}: the tokenizer's chat template failed on row {index}: {exc}") from exc


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


# --- preference pairs ----------------------------------------------------------------------------

def _preference_texts(row: dict, index: int, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> tuple[str, str, str, bool]:
    """(prompt, prompt + chosen, prompt + rejected) as text, and whether the tokenizer adds its
    special tokens, the way TRL's ``DPOTrainer`` prepares a row: plain text gets EOS appended to each
    answer (unless it ends with it) and is tokenized as ``tok(text)`` is; TRL's conversational form
    (message lists) is rendered by the chat template (prompt with the generation prompt), or by the
    fixed ``CHAT_HEADERS`` format (answers end with EOS) when the tokenizer has none."""
    d = cfg.data
    fields = {"data.prompt_column": d.prompt_column, "data.chosen_column": d.chosen_column,
              "data.rejected_column": d.rejected_column}
    values = [row.get(c) for c in fields.values()]
    if isinstance(values[0], str):
        return (*_plain_pair(values, fields, index, tok.eos_token), True)
    if not isinstance(values[0], (list, dict)):
        raise DataError(f"data.prompt_column={d.prompt_column!r}: row {index} holds {shown_value(values[0])}, "
                        "not text or a list of {'role', 'content'} messages; fix or drop that row, or point "
                        "data.prompt_column at the prompt column")
    return (*_conversation_pair(values, fields, index, tok), False)


def _plain_pair(values: list, fields: dict[str, str], index: int, eos: str) -> tuple[str, str, str]:
    prompt, chosen, rejected = values
    for (field, column), value in zip(list(fields.items())[1:], (chosen, rejected)):
        if not isinstance(value, str):
            raise DataError(f"{field}={column!r}: row {index} holds {shown_value(value)}, but the prompt "
                            f"({fields['data.prompt_column']!r}) is text, so the answers must be text too; fix "
                            "or drop that row (TRL's conversational form: message lists in all three columns)")
        if not value:
            raise DataError(f"{field}={column!r}: row {index} is an empty answer; a pair needs two "
                            "non-empty answers to compare: fix or drop that row")
    chosen, rejected = (a if a.endswith(eos) else a + eos for a in (chosen, rejected))
    return prompt, prompt + chosen, prompt + rejected


def _conversation_pair(values: list, fields: dict[str, str], index: int,
                       tok: "PreTrainedTokenizerBase") -> tuple[str, str, str]:
    turns = [_messages(v, c, index, f) for (f, c), v in zip(fields.items(), values)]
    for (field, column), messages in zip(fields.items(), turns):
        if not messages:
            what = "prompt" if field == "data.prompt_column" else "answer"
            raise DataError(f"{field}={column!r}: row {index} is an empty message list (an empty {what}); "
                            "fix or drop that row")
    prompt, chosen, rejected = turns
    if tok.chat_template:
        field = "data.template='preference'"
        return (_render(tok, prompt, True, index, field), _render(tok, prompt + chosen, False, index, field),
                _render(tok, prompt + rejected, False, index, field))
    fixed = lambda messages: "".join(tok.eos_token if t is None else t for t, _ in _fixed_chat(messages))  # noqa: E731
    return fixed(prompt) + CHAT_HEADERS["assistant"], fixed(prompt + chosen), fixed(prompt + rejected)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def preference_tokenize_fn(cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> Callable[[dict, list[int]], dict]:
    """Batched map function: each pair row -> two documents, ``prompt + chosen`` then ``prompt +
    rejected`` (``ids`` and ``loss``, 1 on the answer tokens only), always two per row in that order.

    As TRL's ``DPOTrainer`` does: the prompt and each prompt + answer are tokenized whole, and the
    answers start where the tokenized prompt and both tokenized prompt + answer texts stop agreeing
    (tokens can merge across the boundary, or a chat template can render the prompt alone
    differently); the prompt tokens are that common prefix, shared by both documents. A pair whose
    answers tokenize the same gives no documents (``prepare_data`` counts and says it): its margin is 0
    whatever the weights, so no DPO loss learns from it."""
    def tokenize(batch: dict, indices: list[int]) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        texts = [_preference_texts(row, i, cfg, tok) for row, i in zip(rows, indices)]
        encoded: list[list[list[int]]] = [[] for _ in texts]
        for special in (True, False):
            picked = [k for k, t in enumerate(texts) if t[3] is special]
            if picked:
                flat = [s for k in picked for s in texts[k][:3]]
                ids = tok(flat, add_special_tokens=special, verbose=False)["input_ids"]
                for j, k in enumerate(picked):
                    encoded[k] = ids[3 * j:3 * j + 3]
        out: dict[str, list] = {"ids": [], "loss": []}
        for (prompt, chosen, rejected), index in zip(encoded, indices):
            if chosen == rejected:
                continue
            n = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
            for full, field in ((chosen, "data.chosen_column"), (rejected, "data.rejected_column")):
                if len(full) - max(n, 1) < 1:  # targets are full[1:]; those at n.. carry loss
                    raise DataError(f"{field}={getattr(cfg.data, field[5:])!r}: row {index}: the answer gives "
                                    "no token to learn after its prompt (empty, or one token without a "
                                    "prompt); fix or drop that row")
                out["ids"].append(full)  # full[:n] is the prompt, the same in both documents
                out["loss"].append([0] * n + [1] * (len(full) - n))
        return out

    return tokenize

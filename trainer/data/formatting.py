"""From one record to one document of token ids and a per-token train mask.

Records are JSON objects (what scripts/prepare_data.py writes into ArrayRecord shards):
  {"text": "..."}                                    plain text
  {"messages": [{"role": "...", "content": "..."}]}  a chat
  {"input_ids": [...], "assistant_mask": [...]}      pre-tokenized (mask only for chats)

Chats use the Qwen template, one message at a time:
  <|im_start|>{role}\\n{content}<|im_end|>\\n
In SFT mode only assistant tokens are trained: the content of each assistant message and the
<|im_end|> that closes it (so the model learns to stop); headers, other roles, newlines between
messages, BOS and EOS are context only.

A document is `[bos] + tokens + [eos]` (bos and eos as configured), truncated to max_len + 1 tokens;
inputs = doc[:-1] and targets = doc[1:], so the last real token's target is the EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.tokenizer import IM_END, IM_START, Tokenizer


class RecordError(ValueError):
    """A record that cannot become a document; the caller adds where it came from."""


def chat_text(messages: list[dict[str, str]]) -> str:
    """The chat rendered as text with the template (for tokenizer training and for reading)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def check_messages(messages: Any, field: str = "messages") -> list[dict[str, str]]:
    """Messages as a list of {role, content} strings, or RecordError saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"field {field!r} must be a non-empty list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError(f"{field}[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content", "")
        if not isinstance(role, str) or not role or "\n" in role:
            raise RecordError(f"{field}[{i}].role must be a one-line string, got {role!r}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RecordError(f"{field}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def encode_chat(messages: list[dict[str, str]], tok: Tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the templated chat and a mask with 1 exactly on assistant content + its <|im_end|>."""
    if tok.im_start_id is None or tok.im_end_id is None:
        raise RecordError(
            f"the tokenizer {tok.path} has no {IM_START}/{IM_END} tokens, which chat records "
            "need; train one with scripts/train_tokenizer.py (it reserves them)"
        )
    newline = tok.encode("\n")
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        header = [tok.im_start_id, *tok.encode(m["role"] + "\n")]
        body = [*tok.encode(m["content"]), tok.im_end_id]
        trained = 1 if m["role"] == "assistant" else 0
        ids += header + body + newline
        mask += [0] * len(header) + [trained] * len(body) + [0] * len(newline)
    return ids, mask


@dataclass(frozen=True)
class DocumentFormat:
    """How records become documents: which fields, SFT or not, BOS/EOS, maximum length."""

    text_field: str = "text"
    messages_field: str = "messages"
    use_sft: bool = False
    add_bos: bool = False
    add_eos: bool = True
    max_len: int = 2048  # tokens of inputs (= of targets); a document keeps at most max_len + 1

    def tokens(self, record: dict, tok: Tokenizer) -> tuple[list[int], list[int]]:
        """Body token ids and train mask of one parsed record (no BOS/EOS yet)."""
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list):
                raise RecordError("field 'input_ids' must be a list of token ids")
            mask = record.get("assistant_mask")
            if self.use_sft:
                if mask is None:
                    raise RecordError(
                        "use_sft=true needs chat records, but this pre-tokenized record has no "
                        "'assistant_mask' (it was made from text); set use_sft=false"
                    )
                if len(mask) != len(ids):
                    raise RecordError("'assistant_mask' and 'input_ids' differ in length")
                return ids, mask
            return ids, [1] * len(ids)
        if self.messages_field in record:
            messages = check_messages(record[self.messages_field], self.messages_field)
            ids, mask = encode_chat(messages, tok)
            return ids, (mask if self.use_sft else [1] * len(ids))
        if self.use_sft:
            raise RecordError(
                f"use_sft=true needs a {self.messages_field!r} field (a chat), record has "
                f"fields {sorted(record)}; set messages_field=... or use_sft=false"
            )
        if self.text_field not in record:
            raise RecordError(
                f"record has no {self.text_field!r} or {self.messages_field!r} field (fields: "
                f"{sorted(record)}); set text_field=... or messages_field=... to the right name"
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise RecordError(f"field {self.text_field!r} must be a string, got {type(text).__name__}")
        ids = tok.encode(text)
        return ids, [1] * len(ids)

    def document(self, raw: bytes, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) int32 arrays of one stored record, with BOS/EOS and truncation applied."""
        ids, mask = self.tokens(parse_record(raw), tok)
        return self.finish(ids, mask, tok)

    def finish(
        self, ids: list[int], mask: list[int], tok: Tokenizer, *, trained_eos: bool | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """BOS/EOS as configured and truncation to max_len + 1 tokens; the EOS is trained unless SFT
        (`trained_eos` overrides)."""
        if self.add_bos:
            ids, mask = [tok.bos_id, *ids], [0, *mask]
        if self.add_eos:
            # The EOS is a target the model should learn, except in SFT where only assistant tokens count.
            eos_mask = (not self.use_sft) if trained_eos is None else trained_eos
            ids, mask = [*ids, tok.eos_id], [*mask, int(eos_mask)]
        keep = self.max_len + 1
        return np.asarray(ids[:keep], np.int32), np.asarray(mask[:keep], np.int32)


def parse_record(raw: bytes) -> dict:
    """One stored record as a JSON object, or RecordError."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(
            f"record is not JSON ({e}); ArrayRecord shards must come from "
            "scripts/prepare_data.py (one JSON object per record)"
        ) from None
    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, expected an object")
    return record

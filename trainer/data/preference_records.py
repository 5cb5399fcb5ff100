"""Preference records (DPO data): recognised, validated and counted, never tokenized here.

A preference record pairs a prompt with a preferred and a dispreferred reply, in one of TRL's two
formats, the same in all three fields:
  conversational  {"prompt": [{"role", "content"}, ...], "chosen": [{"role": "assistant", ...}, ...],
                   "rejected": [{"role": "assistant", ...}, ...]}
  standard        {"prompt": "text", "chosen": "text", "rejected": "text"}
A JSON object with a "chosen" or a "rejected" field is a preference record. `check_preference` returns
it normalized (exactly those three fields, messages as {role, content} strings) or raises
PreferenceRecordError naming the field and the fix. scripts/prepare_data.py writes the records through
as JSON (the trainer renders and tokenizes each pair), and refuses an input holding a bad one.
"""

from __future__ import annotations

import numpy as np

from trainer.data.formatting import (
    DocumentFormat,
    RecordError,
    chat_text,
    check_messages,
    encode_chat,
    parse_record,
)
from trainer.data.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
FORMATS = (
    "either all three strings (standard) or all three lists of {role, content} messages (conversational), "
    "with chosen and rejected holding only assistant messages"
)


class PreferenceRecordError(RecordError):
    """A record that is meant as a preference pair (it has "chosen" or "rejected") but is not a valid one."""


def is_preference(obj: dict) -> bool:
    """Whether a JSON object is meant as a preference record."""
    return "chosen" in obj or "rejected" in obj


def _fail(problem: str) -> PreferenceRecordError:
    needs = f"a record needs {', '.join(FIELDS)}: {FORMATS}"
    return PreferenceRecordError(f"bad preference record: {problem} ({needs})")


def check_preference(obj: dict) -> dict:
    """The record as {"prompt", "chosen", "rejected"} in one format, or PreferenceRecordError."""
    missing = [f for f in FIELDS if obj.get(f) is None]
    if missing:
        hint = (
            "; put the conversation before the replies in 'prompt' and only the replies in 'chosen'/'rejected'"
            if missing == ["prompt"]
            else ""
        )
        raise _fail(f"missing field {', '.join(repr(f) for f in missing)}{hint}")
    for f in FIELDS:
        if not isinstance(obj[f], str | list):
            raise _fail(f"field {f!r} is a {type(obj[f]).__name__}, not a string or a list of messages")
    kinds = {f: type(obj[f]) for f in FIELDS}
    if all(k is str for k in kinds.values()):
        for f in FIELDS:
            if not obj[f].strip():
                raise _fail(f"field {f!r} is empty")
        return {f: obj[f] for f in FIELDS}
    if not all(k is list for k in kinds.values()):
        shown = ", ".join(f"{f} is a {k.__name__}" for f, k in kinds.items())
        raise _fail(f"the fields mix formats ({shown})")
    out = {}
    for f in FIELDS:
        try:
            out[f] = check_messages(obj[f], f)
        except RecordError as e:
            raise _fail(str(e)) from None
    for f in ("chosen", "rejected"):
        for i, m in enumerate(out[f]):
            if m["role"] != "assistant":
                raise _fail(f"{f}[{i}].role is {m['role']!r}, not 'assistant'; move that message into 'prompt'")
    return out


def preference_tokens(record: dict, tok: Tokenizer) -> int:
    """The tokens of both sequences a pair becomes (prompt + chosen, prompt + rejected), without BOS/EOS:
    a conversational pair templated like a chat, a standard pair as the prompt's text then the reply's."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
        replies = len(tok.encode(record["chosen"])) + len(tok.encode(record["rejected"]))
        return 2 * len(tok.encode(prompt)) + replies
    return sum(len(encode_chat(prompt + record[f], tok)[0]) for f in ("chosen", "rejected"))


def preference_text(record: dict) -> str:
    """All of a pair's text once (for tokenizer training): a conversational pair templated like a chat."""
    if isinstance(record["prompt"], str):
        return "\n".join(record[f] for f in FIELDS)
    return chat_text(record["prompt"] + record["chosen"] + record["rejected"])


def preference_documents(
    obj: dict, tok: Tokenizer
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(chosen, rejected) of a stored record, each (ids, mask) of prompt + reply without BOS/EOS, the mask 1
    exactly on the reply: a conversational pair templated like a chat (its reply's assistant content and
    <|im_end|>, as SFT trains them), a standard pair as the prompt's text then the reply's (all of it).
    PreferenceRecordError if the record is not a valid pair."""
    record = check_preference(obj)
    prompt = record["prompt"]
    out = []
    for f in ("chosen", "rejected"):
        if isinstance(prompt, str):
            context, reply = tok.encode(prompt), tok.encode(record[f])
            out.append(([*context, *reply], [0] * len(context) + [1] * len(reply)))
        else:
            context, _ = encode_chat(prompt, tok)
            reply, reply_mask = encode_chat(record[f], tok)
            out.append(([*context, *reply], [0] * len(context) + reply_mask))
    return out[0], out[1]


def pair_documents(
    fmt: DocumentFormat, raw: bytes, tok: Tokenizer
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The (chosen, rejected) documents of one stored preference record (objective=dpo): prompt + reply
    each, trained on the reply only (`preference_documents`), with `fmt`'s BOS/EOS (untrained, as in SFT)
    and truncation applied."""
    chosen, rejected = preference_documents(parse_record(raw), tok)
    return fmt.finish(*chosen, tok, trained_eos=False), fmt.finish(*rejected, tok, trained_eos=False)

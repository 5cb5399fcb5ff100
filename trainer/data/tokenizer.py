"""Tokenizers: a sentencepiece model or a Hugging Face `tokenizer.json`, behind one small class.

The chat special tokens are part of the contract between data preparation, training and inference:
  <|im_start|> <|im_end|>  open and close a chat message (Qwen style)
  <|endoftext|>            end of document (the EOS appended to every document)
  <|pad|>                  padding (never trained: padding has segment id 0 and loss mask 0)
`train_sentencepiece` reserves them (plus a few tool-call tags and "\n") in every model it trains.

A `Tokenizer` pickles as its path and kind, so Grain worker processes load their own copy.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable
from pathlib import Path

from trainer.data.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
IM_START, IM_END, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"
CHAT_TOKENS = (IM_START, IM_END, EOS, PAD)
# Reserved on top of the chat tokens: single pieces for the tool-call tags and for newline (JSON and
# chat turns are full of them).
EXTRA_SYMBOLS = ("<tool_call>", "</tool_call>", "<tools>", "</tools>", "\n")
KINDS = ("sentencepiece", "huggingface")
_EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|end_of_text|>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>")
_PAD_CANDIDATES = (PAD, "<pad>")


def resolve_asset_path(path: str) -> Path:
    """A local file for `path`: relative to the working directory if it exists there, else to the
    repository (bundled assets); `~` expanded; a gs:// object is copied to the per-host cache."""
    from trainer.io.paths import local_copy, resolve_input

    resolved = resolve_input(path)
    if not resolved.is_file():
        return Path(os.fspath(resolved))
    return local_copy(resolved)


class Tokenizer:
    """Text <-> token ids, and the ids of the special tokens (None where the vocabulary lacks one)."""

    def __init__(self, path: str | Path, kind: str = "sentencepiece"):
        if kind not in KINDS:
            raise DataError(f"tokenizer_type={kind!r} is not one of {', '.join(KINDS)}")
        from trainer.io.paths import looked_at

        resolved = resolve_asset_path(str(path))
        if not resolved.is_file():
            raise DataError(
                f"tokenizer_path={str(path)!r} not found (looked at {looked_at(str(path))}); "
                "point tokenizer_path at a sentencepiece .model or a "
                "tokenizer.json, or train one with scripts/train_tokenizer.py"
            )
        self.path, self.kind = resolved.resolve(), kind
        self._impl = None
        self._load()

    # -- pickling: workers reload from the file ---------------------------------------------------
    def __getstate__(self):
        return {"path": self.path, "kind": self.kind}

    def __setstate__(self, state):
        self.path = state["path"]
        self.kind = state["kind"]
        self._impl = None
        self._load()

    def _load(self) -> None:
        try:
            if self.kind == "sentencepiece":
                import sentencepiece as spm

                self._impl = spm.SentencePieceProcessor(model_file=str(self.path))
                self.vocab_size = self._impl.get_piece_size()
            else:
                import tokenizers

                self._impl = tokenizers.Tokenizer.from_file(str(self.path))
                self.vocab_size = self._impl.get_vocab_size(with_added_tokens=True)
        except Exception as e:  # noqa: BLE001 - the libraries raise RuntimeError/OSError/Exception
            hint = (
                "a sentencepiece .model file" if self.kind == "sentencepiece" else "a Hugging Face tokenizer.json"
            )
            raise DataError(
                f"cannot load {self.path} as {hint} (tokenizer_type={self.kind}): {e}; "
                "check tokenizer_path and tokenizer_type"
            ) from None
        self.eos_id = self._first_id(_EOS_CANDIDATES, builtin=self._builtin("eos_id"))
        self.bos_id = self._first_id(_BOS_CANDIDATES, builtin=self._builtin("bos_id"))
        self.pad_id = self._first_id(_PAD_CANDIDATES, builtin=self._builtin("pad_id"))
        self.im_start_id = self.token_id(IM_START)
        self.im_end_id = self.token_id(IM_END)

    def _builtin(self, name: str) -> int | None:
        if self.kind != "sentencepiece":
            return None
        value = getattr(self._impl, name)()
        return value if value >= 0 else None

    def _first_id(self, pieces: Iterable[str], builtin: int | None) -> int | None:
        if builtin is not None:
            return builtin
        for piece in pieces:
            i = self.token_id(piece)
            if i is not None:
                return i
        return None

    def token_id(self, piece: str) -> int | None:
        """The id of a whole piece (special token), or None if it is not in the vocabulary."""
        if self.kind == "sentencepiece":
            i = self._impl.piece_to_id(piece)
            return None if i == self._impl.unk_id() and piece != self._impl.id_to_piece(i) else i
        return self._impl.token_to_id(piece)

    def encode(self, text: str) -> list[int]:
        if self.kind == "sentencepiece":
            return self._impl.encode(text)
        return self._impl.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; chat tokens stay visible (sentencepiece drops control tokens: EOS, pad)."""
        if self.kind == "sentencepiece":
            return self._impl.decode([int(i) for i in ids])
        return self._impl.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        """A short hash of the tokenizer file: pre-tokenized data records the one it was made with."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]


def train_sentencepiece(
    texts: Iterable[str],
    output_model: str | Path,
    *,
    vocab_size: int = 8192,
    model_type: str = "bpe",
    max_sentence_bytes: int = 8192,
    num_threads: int = 1,
) -> Path:
    """Train a sentencepiece model over `texts` with the chat tokens reserved; returns the .model path.

    Ids 0/1/2 are <|pad|>, <unk>, <|endoftext|> (the EOS); <|im_start|>, <|im_end|>, the tool tags and
    "\\n" follow as user-defined symbols. No normalisation, no dummy prefix and byte fallback make
    decode(encode(text)) == text for any UTF-8 text, JSON and newlines included. Pieces may mix
    letters and punctuation (`{"name":`), which roughly halves the tokens of JSON-heavy chats.
    """
    import sentencepiece as spm

    out = Path(output_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(texts, max_sentence_bytes),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=True,
        pad_id=0,
        unk_id=1,
        eos_id=2,
        bos_id=-1,
        pad_piece=PAD,
        eos_piece=EOS,
        user_defined_symbols=[IM_START, IM_END, *EXTRA_SYMBOLS],
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        split_by_unicode_script=False,
        max_sentence_length=max_sentence_bytes,
        num_threads=num_threads,
        minloglevel=2,
    )
    out.write_bytes(model.getvalue())
    return out


def _chunks(texts: Iterable[str], max_bytes: int):
    """Split long texts at line boundaries so sentencepiece does not skip them."""
    for text in texts:
        if len(text.encode()) <= max_bytes:
            yield text
            continue
        chunk = ""
        for line in text.splitlines(keepends=True):
            if chunk and len((chunk + line).encode()) > max_bytes:
                yield chunk
                chunk = ""
            chunk += line[: max_bytes // 4] if len(line.encode()) > max_bytes else line
        if chunk:
            yield chunk

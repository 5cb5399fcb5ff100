"""The checkpoint's tokenizer as lm-eval needs it: encode, and decode with or without special tokens.

The tokenizer is the trainer's own (trainer/data/tokenizer.py, tokenizer_path / tokenizer_type the run
recorded), so evaluation sees the token ids training saw. A run with add_bos=true gets its BOS prepended
here too, unless the text already starts with it or the caller asks for no special tokens. `visible`
decodes as transformers' `skip_special_tokens=True` does: a tokenizer.json's special added tokens are
left out (so are, for a sentencepiece model, its control tokens and the chat tokens); `shown` keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence


class Text:
    def __init__(self, path: str, kind: str, *, add_bos: bool):
        from trainer.data.tokenizer import CHAT_TOKENS, Tokenizer

        self.tokenizer = Tokenizer(path, kind)
        self.add_bos = add_bos and self.tokenizer.bos_id is not None
        if kind == "huggingface":
            import tokenizers

            added = tokenizers.Tokenizer.from_file(str(self.tokenizer.path)).get_added_tokens_decoder()
            special = {i for i, token in added.items() if token.special}
        else:
            ids = [self.tokenizer.token_id(piece) for piece in CHAT_TOKENS]
            special = {i for i in ids if i is not None}
        named = (self.tokenizer.eos_id, self.tokenizer.bos_id, self.tokenizer.pad_id)
        self.special_ids = frozenset(special | {i for i in named if i is not None})

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS first when the run prepends it (add_bos) and special tokens are not
        refused, unless `text` already starts with the BOS piece."""
        ids = self.tokenizer.encode(text)
        if self.add_bos and add_special_tokens is not False and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def shown(self, ids: Sequence[int]) -> str:
        """The text of `ids` with special tokens shown (lm-eval's stop check, its EOS string)."""
        return self.tokenizer.decode(ids)

    def visible(self, ids: Sequence[int]) -> str:
        """The text of `ids` without special tokens (`skip_special_tokens=True`): a generation's answer."""
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids])

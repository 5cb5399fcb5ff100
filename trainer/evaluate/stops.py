"""When a greedy continuation is finished, and the text lm-eval gets back from it.

The rules are those of lm-eval's Hugging Face backend on a trainer-to-hf export (whose config.json names
the tokenizer's EOS): a row ends at its EOS token, once one of the stop sequences (`until`) appears in its
text, or after max_gen_toks tokens. Its text is the decoded tokens before the EOS with special tokens left
out (`skip_special_tokens=True`), cut before the first stop sequence (lm-eval's own
`postprocess_generated_text`: each stop in turn, empty ones ignored). Whether a row is done is judged on
the text with the special tokens shown, as lm-eval's stopping criterion does, so a stop sequence such as
"<|im_end|>" ends a row too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class StopRule:
    until: tuple[str, ...]  # stop sequences; empty strings are ignored
    eos_id: int | None  # the EOS token: ends a row, never part of its text

    def done(self, tokens: Sequence[int], shown: Decode) -> bool:
        """Whether the continuation `tokens` (so far) is finished: its last token is the EOS, or a stop
        sequence appears in `shown(tokens)`, its text with special tokens shown."""
        if self.eos_id is not None and tokens and tokens[-1] == self.eos_id:
            return True
        text = shown(tokens)
        return any(stop and stop in text for stop in self.until)

    def text(self, tokens: Sequence[int], visible: Decode) -> str:
        """The answer lm-eval scores: `visible` text (special tokens left out) of the tokens before the EOS,
        cut before the first stop sequence."""
        tokens = list(tokens)
        if self.eos_id is not None and self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id)]
        out = visible(tokens)
        for stop in self.until:
            if stop:
                out = out.split(stop)[0]
        return out

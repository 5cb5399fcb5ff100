"""lm-eval's model interface over a checkpoint of this trainer, registered as the model "elastic-trainer".

`TrainerLM` subclasses lm-eval's `TemplateLM`, so the splitting of a request into context and continuation
tokens (`_encode_pair`, the empty-context prefix token) is lm-eval's own; it implements the rest as
lm-eval's Hugging Face backend (`HFLM`) does, on the backend of backend.py:

- `_loglikelihood_tokens`: (summed log-prob, is_greedy) per request, batched longest first (scoring.py);
- `loglikelihood_rolling`: lm-eval's own disjoint rolling windows of max_length tokens after the prefix
  token, all windows of all documents scored in batches, summed per document;
- `generate_until`: greedy only (a request that asks to sample is decoded greedily, with a warning);
  requests grouped by their generation kwargs and sorted longest first (lm-eval's `Collator`), the
  context cut from the left to max_length - max_gen_toks tokens, stop rules of stops.py.

The prefix token is BOS where the tokenizer has one, else EOS, as in `HFLM`. In Python,
`lm_eval.simple_evaluate(model="elastic-trainer", model_args={"path": RUN_DIR_OR_CHECKPOINT}, ...)` works
once this module is imported; `python -m trainer.evaluate` is the command line.
"""

from __future__ import annotations

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from trainer.evaluate.backend import open_backend
from trainer.evaluate.stops import StopRule

log = logging.getLogger(__name__)
MODEL_NAME = "elastic-trainer"


@register_model(MODEL_NAME)
class TrainerLM(TemplateLM):
    """A checkpoint of this trainer (RUN_DIR_OR_CHECKPOINT `path`) as an lm-eval model."""

    def __init__(
        self,
        path: str,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        dtype: str = "float32",
        model: str | None = None,
        **unused,
    ):
        super().__init__()
        from trainer.errors import UserInputError

        if unused.keys() - {"max_batch_size", "device"}:  # lm-eval passes these to every model
            raise UserInputError(f"unknown {MODEL_NAME} model_args {sorted(unused)}")
        if not str(batch_size).isdigit():
            raise UserInputError(f"batch_size={batch_size!r}: give a number of rows (no 'auto')")
        self.backend = open_backend(
            path,
            model=model,
            batch_size=int(batch_size),
            max_length=int(max_length) if max_length else None,
            dtype=dtype,
        )
        self.text, self._max_gen_toks = self.backend.text, int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.text.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.bos_id if self.text.bos_id is not None else self.text.eos_id

    @property
    def max_length(self) -> int:
        return self.backend.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else tokens
        return self.text.visible(tokens) if skip_special_tokens else self.text.shown(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each ((context, continuation), context ids, continuation ids)."""
        answers = self.backend.scorer.score([(ctx, cont) for _, ctx, cont in requests])
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole document, over lm-eval's rolling windows of max_length."""
        windows, owner = [], []
        for i, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm)):
            tokens = self.tok_encode(string)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.backend.scorer.score(windows)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut at its stop sequences (stops.py)."""
        order = Collator(
            [r.args for r in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda req: req[1],
        )
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        out = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for chunk in order.get_batched(n=self.backend.rows):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            if kwargs.get("do_sample"):
                log.warning("generation kwargs %s ask to sample: %s decodes greedily", all_kwargs[0], MODEL_NAME)
            rule = StopRule(tuple(handle_stop_sequences(kwargs.pop("until", None), eos=eos)), self.eot_token_id)
            for context, text in zip(contexts, self._generate(list(contexts), kwargs["max_gen_toks"], rule)):
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
            progress.update(len(chunk))
        progress.close()
        return order.get_original(out)

    def _generate(self, contexts: list[str], max_gen_toks: int, rule: StopRule) -> list[str]:
        keep = self.max_length - max_gen_toks  # context tokens that leave room for the generation
        if keep < 1:
            raise ValueError(
                f"max_gen_toks {max_gen_toks} leaves no room for a context in max_length {self.max_length}"
            )
        prompts = [self.tok_encode(c)[-keep:] or [self.prefix_token_id] for c in contexts]
        tokens = self.backend.generator.generate(prompts, max_gen_toks, lambda t: rule.done(t, self.text.shown))
        return [rule.text(t, self.text.visible) for t in tokens]

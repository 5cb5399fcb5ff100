"""Train a sentencepiece tokenizer over training data, with the chat special tokens reserved.

  python scripts/train_tokenizer.py --input 'raw/*.jsonl' --output data/tokenizer/mine.model --vocab-size 8192

Inputs are whatever scripts/prepare_data.py reads (JSONL/JSON text or chats, Parquet, plain text) or the
ArrayRecord shards it wrote. Chats are seen as their templated text, so the role headers tokenize as
they will in training. <|pad|>=0, <unk>=1, <|endoftext|>=2 (EOS), then <|im_start|>, <|im_end|>, the
tool-call tags and "\\n" as single pieces (trainer/data/tokenizer.py).
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.errors import DataError  # noqa: E402
from trainer.data.formatting import RecordError, chat_text  # noqa: E402
from trainer.data.preference_records import is_preference, preference_text  # noqa: E402
from trainer.data.prepare import INPUT_HELP, add_record_arguments  # noqa: E402
from trainer.data.readers import check_inputs, expand_inputs, read_records  # noqa: E402
from trainer.data.shards import Summary, no_usable_record, output_path  # noqa: E402
from trainer.data.tokenizer import CHAT_TOKENS, EXTRA_SYMBOLS, Tokenizer, train_sentencepiece  # noqa: E402
from trainer.errors import tool_main  # noqa: E402
from trainer.io.staging import check_writable, staged_file  # noqa: E402

PROG = "train_tokenizer.py"
# Pieces every model holds before it learns any: pad, unk, EOS, the user-defined symbols, 256 byte pieces.
RESERVED_PIECES = 3 + 2 + len(EXTRA_SYMBOLS) + 256
_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\).*<= (\d+)")
_TOO_LOW = re.compile(r"smaller than required_chars\. (\d+) vs (\d+)")

EPILOG = f"""\
{INPUT_HELP}
If no record is usable, the error says how many lacked the field and which name was expected.

output:
  --output      the sentencepiece .model file, a local path (its folders are created). It is written
                aside and renamed into place only when training succeeded; an existing file is replaced
                only with --overwrite, and a failed run leaves nothing behind.
  Use it with tokenizer_path=<--output> (and for pre-tokenized shards: prepare_data.py --tokenizer).

vocabulary:
  --vocab-size must fit the data: at least the {RESERVED_PIECES} reserved pieces plus every distinct character,
  at most what the text's merges allow. When it does not fit, the error names a size that does.

exit codes:
  0  success (the model, its vocabulary and the special-token ids are printed on stdout)
  2  bad input or arguments: a glob matching no file, a binary file, no usable record, a vocabulary
     size the data cannot fill, an existing --output without --overwrite; one line on stderr:
     "{PROG}: error: ..."
  1  a bug (with its traceback)
"""


class TrainingTexts:
    """The texts sentencepiece trains on, counting used and bad records as it goes.

    sentencepiece turns an exception raised by its input iterator into a bare RuntimeError, so the
    original is kept here and raised again after training stopped."""

    def __init__(self, files, *, text_field, messages_field, text_unit, limit):
        self.files, self.limit = files, limit
        self.fields = {"text_field": text_field, "messages_field": messages_field, "text_unit": text_unit}
        self.summary = Summary()
        self.chars = 0
        self.failure: BaseException | None = None

    def __iter__(self):
        try:
            yield from self._texts()
        except Exception as e:  # re-raised by the caller, with its traceback
            self.failure = e
            raise

    def _texts(self):
        for path in self.files:
            for where, record in read_records(path, **self.fields):
                if isinstance(record, RecordError):
                    self.summary.add_bad(where, record)
                    continue
                if self.summary.records >= self.limit:
                    return
                self.summary.records += 1
                if is_preference(record):
                    text = preference_text(record)
                else:
                    text = chat_text(record["messages"]) if "messages" in record else record["text"]
                self.chars += len(text)
                yield text

    def skipped(self) -> str:
        """'' or '; N record(s) skipped: <reasons>; first: <file:line>: <why>' for an error message."""
        bad = sum(self.summary.bad.values())
        return f"; {bad:,} record(s) skipped: {self.summary.bad_brief()}" if bad else ""


def training_error(error: RuntimeError, texts: TrainingTexts, vocab_size: int) -> DataError:
    """sentencepiece's error as what to change: the vocabulary size that fits, or the missing records."""
    used = texts.summary.records
    if used == 0:
        return no_usable_record(texts.files, texts.summary)
    message = str(error)
    data = f"{used:,} record(s) ({texts.chars:,} characters)"
    if m := _TOO_HIGH.search(message):
        return DataError(
            f"--vocab-size {vocab_size} is more than the training text can fill: {data} give at "
            f"most {int(m[2])} pieces; pass --vocab-size {int(m[2])}, or train on more text"
            f"{texts.skipped()}"
        )
    if m := _TOO_LOW.search(message):
        return DataError(
            f"--vocab-size {vocab_size} is too small for this text: it needs at least {int(m[2])} "
            f"pieces ({RESERVED_PIECES} reserved plus one per distinct character); pass "
            f"--vocab-size {int(m[2])} or more"
        )
    detail = message.split("] ", 1)[-1].strip() or message.strip()
    return DataError(f"sentencepiece training failed on {data}: {detail}{texts.skipped()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", action="append", required=True, help="file or glob (repeatable, comma-separated); formats below"
    )
    parser.add_argument("--output", required=True, help="path of the .model file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--vocab-size", type=int, default=8192, help="pieces in the model (default: %(default)s)")
    parser.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    parser.add_argument("--max-records", type=int, default=200_000, help="train on at most this many records")
    add_record_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.vocab_size < 1 or args.max_records < 1:
        raise DataError(f"--vocab-size ({args.vocab_size}) and --max-records ({args.max_records}) must be >= 1")
    output = output_path(args.output, "--output")
    if output.is_dir():  # --overwrite would replace the whole folder with one file
        raise DataError(
            f"--output {output} is a directory; name the model file, e.g. --output {output}/mine.model"
        )
    check_writable(output, overwrite=args.overwrite)
    files = expand_inputs(args.input)
    check_inputs(files)
    texts = TrainingTexts(
        files,
        text_field=args.text_field,
        messages_field=args.messages_field,
        text_unit=args.text_unit,
        limit=args.max_records,
    )
    with staged_file(output, overwrite=args.overwrite) as staging:
        try:
            train_sentencepiece(texts, staging, vocab_size=args.vocab_size, model_type=args.model_type)
        except RuntimeError as e:
            if texts.failure is not None:
                raise texts.failure from None
            raise training_error(e, texts, args.vocab_size) from None
        tok = Tokenizer(staging)  # a model that does not load is not moved into place
    special = ", ".join(f"{t}={tok.token_id(t)}" for t in CHAT_TOKENS)
    print(
        f"wrote {output} ({output.stat().st_size:,} bytes): vocab {tok.vocab_size}, trained on "
        f"{texts.summary.records:,} records; special tokens {special}"
    )
    if texts.summary.bad:
        print(f"skipped {sum(texts.summary.bad.values()):,} record(s): {texts.summary.bad_brief()}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return tool_main(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

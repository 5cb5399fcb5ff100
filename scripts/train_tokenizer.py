"""Train a sentencepiece tokenizer over training data, with the chat special tokens reserved.

  python scripts/train_tokenizer.py --input 'raw/*.jsonl' --output data/tokenizer/mine.model --vocab-size 8192

Inputs are whatever scripts/prepare_data.py reads (JSONL text or chats, plain text, Parquet) or the
ArrayRecord shards it wrote. Chats are seen as their templated text, so the role headers tokenize as
they will in training. <|pad|>=0, <unk>=1, <|endoftext|>=2 (EOS), then <|im_start|>, <|im_end|>, the
tool-call tags and "\\n" as single pieces (trainer/data/tokenizer.py). Exit code 2 on a data error.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.errors import DataError  # noqa: E402
from trainer.data.formatting import chat_text  # noqa: E402
from trainer.data.prepare import TEXT_UNITS, expand_inputs, read_records  # noqa: E402
from trainer.data.tokenizer import CHAT_TOKENS, Tokenizer, train_sentencepiece  # noqa: E402


def texts(files, *, text_field, messages_field, text_unit, limit, counts):
    for path in files:
        for _, record in read_records(path, text_field=text_field, messages_field=messages_field,
                                      text_unit=text_unit):
            if not isinstance(record, dict):
                counts["bad"] += 1
                continue
            if counts["used"] >= limit:
                return
            counts["used"] += 1
            yield chat_text(record["messages"]) if "messages" in record else record["text"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", action="append", required=True, help="file or glob (repeatable)")
    parser.add_argument("--output", required=True, help="path of the .model file to write")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    parser.add_argument("--max-records", type=int, default=200_000, help="train on at most this many records")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--messages-field", default="messages")
    parser.add_argument("--text-unit", default="paragraph", choices=TEXT_UNITS)
    args = parser.parse_args(argv)
    counts = {"used": 0, "bad": 0}
    try:
        files = expand_inputs(args.input)
        stream = texts(files, text_field=args.text_field, messages_field=args.messages_field,
                       text_unit=args.text_unit, limit=args.max_records, counts=counts)
        try:
            path = train_sentencepiece(stream, args.output, vocab_size=args.vocab_size, model_type=args.model_type)
        except RuntimeError as e:  # sentencepiece: e.g. vocab too large for the data
            raise DataError(f"sentencepiece training failed: {e}; use more data or a smaller --vocab-size") from None
        tok = Tokenizer(path)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    special = ", ".join(f"{t}={tok.token_id(t)}" for t in CHAT_TOKENS)
    print(f"wrote {path} ({path.stat().st_size:,} bytes): vocab {tok.vocab_size}, trained on "
          f"{counts['used']:,} records ({counts['bad']:,} bad skipped); special tokens {special}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Convert JSONL, JSON, Parquet and plain text files into ArrayRecord shards of JSON records.

  python scripts/prepare_data.py --input 'raw/*.jsonl' --output-dir data/mine --num-shards 8 \\
      [--tokenizer data/tokenizer/fc_sp8k.model]

Every input record becomes {"text": ...} or {"messages": [...]}, or with a tokenizer
{"input_ids": [...]} (+ "assistant_mask" for chats, see trainer/data/formatting.py); a preference
record stays {"prompt", "chosen", "rejected"} (trainer/data/preference_records.py). Records that
cannot be used (invalid JSON, not UTF-8, a missing field) are counted by reason and reported with
their file and line, never dropped silently. Shards get records round-robin, so they hold equal
shares; `dataset_info.json` records the summary. The shards are written aside and moved into place
only when the run succeeded: a failed run leaves the old output untouched.

Parallel and resumable (trainer/data/shards.py): --workers processes tokenize work units fixed by the
inputs (a file, or a --unit-size byte range of a big JSONL or line-per-record text file), and the
shards are byte-identical whatever the worker count. A run that is stopped (Ctrl-C, kill -9, a lost
machine) and rerun with the same command skips the units it completed. Inputs and --output-dir may
be local or gs://. The summary reports tokens/s and tokens/s per core.
"""

# The CLI only: it parses the arguments, calls the library (trainer/data/readers.py reads the inputs,
# trainer/data/shards.py writes the shards) and maps its errors to one line and exit 2
# (trainer.errors.tool_main). INPUT_HELP and add_record_arguments are shared with scripts/train_tokenizer.py.

from __future__ import annotations

import argparse
import logging
import re
import sys

from trainer.data.prepare_units import UNIT_BYTES, available_cpus
from trainer.data.readers import SHARD_SUFFIX, TEXT_UNITS, expand_inputs
from trainer.data.shards import INFO_FILE, prepare
from trainer.data.tokenizer import Tokenizer
from trainer.errors import tool_main

INPUT_HELP = """\
inputs (--input, repeatable; comma-separated globs; local, ~ or gs:// paths):
  .jsonl, .ndjson  one JSON object per line
  .json            an array of objects, a single object, or JSON lines
  .parquet         one record per row, from the columns below (needs `pip install pyarrow`)
  .arrayrecord     shards of JSON records written by prepare_data.py (also .array_record)
  any other file   plain UTF-8 text (.txt, .md, .rst, .html, source code, no extension, ...),
                   one record per paragraph, line or file (--text-unit)
  + .gz            gzip-compressed JSONL, JSON or text
A JSON record or Parquet row needs a string field named by --text-field (default "text") or a
chat in the field named by --messages-field (default "messages": a list of {"role", "content"}),
or is a preference pair (for objective=dpo; TRL's formats): "prompt", "chosen" and "rejected",
all three strings, or all three lists of {"role", "content"} with chosen and rejected holding only
assistant messages. Binary files are refused. Unusable records (invalid JSON, bytes that are not
UTF-8, a missing or empty field) are skipped, counted by reason and reported with file:line."""

EPILOG = f"""\
{INPUT_HELP}

outputs:
  <--output-dir>/<prefix>-NNNNN-of-MMMMM{SHARD_SUFFIX}  the records as JSON, round-robin over the shards
                   (preference pairs as they are, even with --tokenizer: "tokens" counts both
                   sequences of each pair; a bad pair, or pairs mixed with other records, exit 2)
  <--output-dir>/{INFO_FILE}                    records, tokens, bad records by reason, shards,
                                                      inputs; the run's units, workers, seconds, tokens/s
  Train on them with dataset_type=arrayrecord grain_train_files='<--output-dir>/*{SHARD_SUFFIX}'.
  --output-dir is a local directory or a gs:// prefix.
  The output is written aside and moved into place only when the run succeeded: a failed run leaves
  an existing output untouched and nothing new behind. An existing output is replaced only with
  --overwrite (and never a directory holding files this tool did not write). A gs:// output is
  built locally, then each shard is uploaded (an object appears only once complete), and
  {INFO_FILE} last: on an object store, {INFO_FILE} marks a complete output.

parallel and resumable:
  --workers N      worker processes (default: the CPUs this process may use); the shards are
                   byte-identical whatever N, and equal to what one process writes
  --unit-size S    work units: one per input file, and uncompressed .jsonl/.ndjson files (plain text
                   with --text-unit line) bigger than S cut into ranges of about S at line starts
                   (default 64M; suffixes K, M, G); bad records keep their file:line
  The work lives in a hidden sibling of --output-dir (.<name>.prepare-<digest>; for a gs:// output,
  under $TRAINER_CACHE_DIR/prepare/, default ~/.cache/elastic-trainer), named by a digest of what
  determines the output (the inputs with their sizes and modification times or generations, the
  tokenizer, the fields, --text-unit, --num-shards, --prefix, --unit-size, --output-dir). A run that
  is stopped (Ctrl-C, kill -9, a lost machine) keeps it; rerun the same command and it skips the
  units already done ("units: N (M completed by an earlier run, skipped)"). It is removed when the
  output is in place, or when the input is bad. It holds the records uncompressed until then: allow
  about twice the output's size of free disk beside it.

exit codes:
  0  success (the summary is printed on stdout)
  2  bad input or arguments: a glob matching no file, a binary file, no usable record, a bad
     preference record (named by file:line), preference pairs mixed with other records, an
     existing output without --overwrite; one line on stderr: "prepare_data.py: error: ..."
  1  a bug (with its traceback)
"""


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """How input files become records: the options prepare_data.py and train_tokenizer.py share."""
    parser.add_argument(
        "--text-field", default="text", help="JSON field / Parquet column with the text (default: %(default)s)"
    )
    parser.add_argument(
        "--messages-field",
        default="messages",
        help="JSON field / Parquet column with a chat, a list of {role, content} (default: %(default)s)",
    )
    parser.add_argument(
        "--text-unit",
        default="paragraph",
        choices=TEXT_UNITS,
        help="plain text files: one record per paragraph (blank-line separated), line or file",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", action="append", required=True, help="file or glob (repeatable, comma-separated); formats below"
    )
    parser.add_argument("--output-dir", required=True, help="directory for the shards and dataset_info.json")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tokenizer", default=None, help="pre-tokenize with this tokenizer (and count tokens)")
    parser.add_argument("--tokenizer-type", default="sentencepiece", choices=("sentencepiece", "huggingface"))
    add_record_arguments(parser)
    parser.add_argument("--prefix", default="data", help="shard name prefix")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"worker processes (default: the CPUs this process may use, here {available_cpus()})",
    )
    parser.add_argument(
        "--unit-size",
        type=_size,
        default=UNIT_BYTES,
        metavar="SIZE",
        help="split uncompressed line-per-record files bigger than this into work units (default: 64M)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output-dir (only once the new shards are written)",
    )
    return parser


def _size(text: str) -> int:
    """A byte count: an integer, optionally with a K, M or G suffix (powers of 1024)."""
    found = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 65536, 512K, 64M or 1G")
    return int(found[1]) * 1024 ** " kmg".index(found[2].lower() or " ")


def _run(args: argparse.Namespace) -> int:
    files = expand_inputs(args.input)
    tok = Tokenizer(args.tokenizer, args.tokenizer_type) if args.tokenizer else None
    summary = prepare(
        files,
        args.output_dir,
        args.num_shards,
        tokenizer=tok,
        text_field=args.text_field,
        messages_field=args.messages_field,
        text_unit=args.text_unit,
        prefix=args.prefix,
        overwrite=args.overwrite,
        workers=args.workers,
        unit_bytes=args.unit_size,
    )
    print(summary.report())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    return tool_main("prepare_data.py", lambda: _run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Convert JSONL / plain text / Parquet files into ArrayRecord shards for dataset_type=arrayrecord.

  python scripts/prepare_data.py --input 'raw/*.jsonl' --output-dir data/mine --num-shards 8 \
      [--tokenizer data/tokenizer/fc_sp8k.model]

Accepts JSONL/JSON, Parquet, ArrayRecord and any plain UTF-8 text file, local or gs://, and writes a
local or gs:// output, with --workers processes (byte-identical shards whatever the count); a stopped
run resumes when rerun with the same command. --help lists the formats, fields, outputs, options and
exit codes (0 success, 2 bad input, as one line "prepare_data.py: error: ..."). See
trainer/data/prepare.py for the record format.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

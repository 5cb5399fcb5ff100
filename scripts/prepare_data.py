"""Convert JSONL / plain text / Parquet files into ArrayRecord shards for dataset_type=arrayrecord.

  python scripts/prepare_data.py --input 'raw/*.jsonl' --output-dir data/mine --num-shards 8 \
      [--tokenizer data/tokenizer/fc_sp8k.model]

Exit code 0 on success, 2 on a data error (bad glob, unsupported file, no usable record).
See trainer/data/prepare.py for the record format.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

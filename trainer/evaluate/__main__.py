"""`python -m trainer.evaluate`: see trainer/evaluate/cli.py."""

import sys

from trainer.evaluate.cli import main

sys.exit(main())

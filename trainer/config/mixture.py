"""`grain_train_files` as a weighted mixture: "pattern_a,0.7;pattern_b,0.3" (MaxText's syntax).

A value without ';' is one source (comma-separated globs, weight 1), so every single-source value keeps
its meaning. With ';' each entry is `<globs>,<weight>`: the weight is the text after the entry's last
comma, so an entry's globs may themselves be comma-separated. Weights are relative (normalised to sum
to 1), must be finite and >= 0, and at least one must be > 0; an entry of weight 0 is left out of the
mixture (its files are not read), which turns a source off without deleting it from the command line.

Parsing imports nothing heavy: config validation runs it before any device work. It lives with the
config (whose validation reports a bad mixture with every other problem), below the data pipeline that
reads the sources; its errors are `DataError`s all the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.errors import DataError


@dataclass(frozen=True)
class Source:
    pattern: str  # comma-separated globs of ArrayRecord shards
    weight: float  # normalised: the weights of a mixture sum to 1


def is_mixture(text: str) -> bool:
    return ";" in text


def parse_mixture(text: str) -> list[Source]:
    """'a,0.7;b,0.3' -> [Source('a', 0.7), Source('b', 0.3)]; DataError naming the bad entry."""
    if not is_mixture(text):
        return [Source(text.strip(), 1.0)]
    entries = [e.strip() for e in text.split(";") if e.strip()]
    parsed = []
    for entry in entries:
        pattern, sep, weight_text = entry.rpartition(",")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not sep or not pattern.strip() or not math.isfinite(weight):
            raise DataError(
                f"grain_train_files entry {entry!r} is not '<glob>,<weight>' with a number as weight; "
                "write a mixture as 'pattern_a,0.7;pattern_b,0.3'"
            )
        if weight < 0:
            raise DataError(
                f"grain_train_files entry {entry!r}: weight {weight_text.strip()} is negative; use a weight >= 0"
            )
        parsed.append((pattern.strip(), weight))
    total = sum(w for _, w in parsed)
    if total <= 0:
        raise DataError(
            f"grain_train_files={text!r}: every weight is 0, so nothing would be read; give at least one "
            "entry a weight > 0"
        )
    return [Source(pattern, weight / total) for pattern, weight in parsed if weight > 0]

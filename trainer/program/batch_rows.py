"""Whole sequences per slice from a per-device batch size that may be a fraction.

`per_device_batch_size` counts every chip of a slice, the context and tensor axes included, but the batch
dimension is split over the data x fsdp x expert axes only (the batch shards). A fraction is how a group
of chips shares one sequence: with `ici_context_parallelism=N` and the rest fsdp, 1/N puts one sequence
on each context group. The value is usable when per_device_batch_size x devices per slice is a whole
number of sequences that splits evenly over the slice's batch shards, i.e. a multiple of
`batch_shards / devices_per_slice` (1 / the chips that share a sequence). A whole value always is.

The count is exact: a decimal such as 0.125 x 8 is 1 sequence, never 0.99999; a value within 1e-9 of a
whole count (the nearest float to 1/3 x 3) counts as that whole number.
"""

from __future__ import annotations

from trainer.errors import ConfigError

_TOLERANCE = 1e-9


def _shown(value: float) -> str:
    """A number as a user types it: whole values without `.0`."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def rows_per_slice(
    value: float,
    *,
    devices_per_slice: int,
    shards_per_slice: int,
    key: str = "per_device_batch_size",
) -> int:
    """The whole sequences (rows) per slice that `key`=`value` gives, exactly, or a ConfigError that names
    the key, the value, the devices per slice and the smallest valid fraction."""
    exact = value * devices_per_slice
    rows = round(exact)
    group = devices_per_slice // max(1, shards_per_slice)  # the chips that share one sequence
    smallest = shards_per_slice / devices_per_slice  # one sequence per batch shard
    fix = f"use a multiple of {_shown(smallest)} (1 sequence per device group of {group})"
    count = f"{key}={_shown(value)} x {devices_per_slice} devices per slice"
    if abs(exact - rows) > _TOLERANCE * max(1.0, abs(exact)):
        raise ConfigError(f"{count} is {exact:.6g} sequences: {fix}")
    if rows < 1:
        raise ConfigError(f"{count} is less than one sequence: {fix}")
    if rows % shards_per_slice:
        raise ConfigError(
            f"{count} is {rows} sequence{'s' if rows != 1 else ''}, which does not split over the slice's "
            f"{shards_per_slice} batch shards (data x fsdp x expert): {fix}"
        )
    return rows


def per_device_text(value: float) -> str:
    """`value` as it goes into a `per_device_batch_size=` override (whole values without `.0`)."""
    return _shown(value)

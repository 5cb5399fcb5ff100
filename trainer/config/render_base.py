"""Render configs/base.yml from the schema: `python -m trainer.config.render_base > configs/base.yml`.

The schema is the single source of defaults; base.yml is its documented rendering, and
tests/test_config.py fails if the two drift.
"""

from __future__ import annotations

import dataclasses
import sys

import yaml

from trainer.config.schema import section_classes


def yaml_scalar(value) -> str:
    """`value` as one YAML flow scalar (what base.yml and the docs' reference show as a default)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def render() -> str:
    lines = [
        "# Defaults of every config key, rendered from trainer/config/schema.py (do not edit by hand:",
        "# run `python -m trainer.config.render_base > configs/base.yml`). Order of precedence:",
        "# this file < configs/models/<model>.yml < your config file < key=value arguments.",
        "",
    ]
    for section, cls in section_classes().items():
        lines.append(f"# ---- {section}: {cls.__doc__.strip().splitlines()[0]}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            doc = f.metadata["doc"]
            if isinstance(default, list) and default:  # an empty list stays `[]` (a bare key is null)
                lines.append(f"# {doc}")
                lines.append(f"{f.name}:")
                lines.extend(f"  - {yaml_scalar(item)}" for item in default)
            else:
                lines.append(f"{f.name}: {yaml_scalar(default)}  # {doc}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())

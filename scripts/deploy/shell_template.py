"""The shell-script templates (xpk, slurm) in scripts/deploy/templates/: `{{name}}` placeholders take a value
inline or, alone on their line, a block of lines indented like the placeholder."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}")
_BLOCK_LINE = re.compile(r"^(\s*)\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}\s*$")


def fill(template: str, values: Mapping[str, str | list[str]]) -> str:
    """Replace `{{name}}` placeholders. A str value goes inline; a list value (block) must be alone on its
    line and each of its lines is indented like the placeholder (an empty block removes the line).
    Every placeholder must have a value and every value must be used."""
    used: set[str] = set()
    out: list[str] = []
    for line in template.splitlines():
        m = _BLOCK_LINE.match(line)
        if m and isinstance(values.get(m.group(2)), list):
            used.add(m.group(2))
            out += [m.group(1) + item for item in values[m.group(2)]]
            continue

        def inline(mm: re.Match) -> str:
            key = mm.group(1)
            if key not in values:
                raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
            if isinstance(values[key], list):
                raise KeyError(f"block placeholder {{{{{key}}}}} must be alone on its line")
            used.add(key)
            return values[key]

        out.append(_PLACEHOLDER.sub(inline, line))
    unused = set(values) - used
    if unused:
        raise KeyError(f"values not used by the template: {sorted(unused)}")
    return "\n".join(out) + "\n"


def load_template(name: str) -> str:
    return (TEMPLATES / name).read_text()

"""Render the configuration reference of docs/configuration.md from the schema.

    python -m scripts.config_reference           # rewrite the reference block of docs/configuration.md
    python -m scripts.config_reference --check   # exit 1 when the block differs from the schema

The schema (`trainer/config/schema.py`) is the single source of every key's default, documentation and
allowed values; the block between the markers below is its rendering, one table per section, and
tests/test_docs_site.py fails when the two drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from trainer.config.render_base import yaml_scalar
from trainer.config.schema import section_classes

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
START = "<!-- config reference: rendered from trainer/config/schema.py by `python -m scripts.config_reference` -->"
END = "<!-- end of config reference -->"


def _cell(text: str) -> str:
    """Text safe in a markdown table cell: pipes escaped, `<...>` shown rather than read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _allowed(meta: dict) -> str:
    if meta["choices"]:
        return " / ".join(f"`{c}`" for c in meta["choices"])
    low, high = meta["minimum"], meta["maximum"]
    bounds = []
    if low is not None:
        bounds.append(f"≥ {yaml_scalar(low)}")
    if meta.get("above") is not None:
        bounds.append(f"> {yaml_scalar(meta['above'])}")
    if high is not None:
        bounds.append(f"≤ {yaml_scalar(high)}")
    text = ", ".join(bounds)
    if meta["auto"]:
        text = f"`auto` or {text}" if text else "`auto` or a number"
    return text


def render() -> str:
    """The reference block: for each config section, its one-line purpose and a table of its keys."""
    out = [START, ""]
    for section, cls in section_classes().items():
        out += [f"### {section}", "", cls.__doc__.strip().splitlines()[0], ""]
        out += ["<!-- not measured: defaults and documentation of the config keys -->"]
        out += ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = yaml_scalar(default)
            if f.metadata["auto"] and default == -1:
                shown = "auto"
            out.append(
                f"| `{f.name}` | `{_cell(shown)}` | {_cell(_allowed(f.metadata))} | {_cell(f.metadata['doc'])} |"
            )
        out.append("")
    out.append(END)
    return "\n".join(out)


def rendered_page(page: str) -> str:
    """`page` with its reference block replaced by the current rendering."""
    head, found, rest = page.partition(START)
    if not found or END not in rest:
        raise SystemExit(f"{PAGE}: the markers of the reference block are missing ({START!r} ... {END!r})")
    return head + render() + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render docs/configuration.md's reference from the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page's block is not current")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = rendered_page(page)
    if args.check:
        if new != page:
            print(f"{PAGE.relative_to(REPO)} is stale: run `python -m scripts.config_reference`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

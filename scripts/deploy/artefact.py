"""What every renderer returns (Rendered) and the comment lines each artefact starts with."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams


@dataclass
class Rendered:
    """One artefact of one target: its file name and text, and the trainer command and warnings behind it."""

    target: str
    filename: str
    text: str
    trainer_argv: list[str]
    warnings: list[str] = field(default_factory=list)
    manifest: dict | None = None  # the Kubernetes object `text` holds (manifest targets only)


def artefact_header(target: str, p: DeployParams) -> list[str]:
    return [
        f"# Rendered by scripts/deploy/render.py (target: {target}); re-render instead of editing.",
        f"# slices={p.slices} image={p.image} run_name={p.run_name} output_dir={p.output_dir} model={p.model}",
    ]


def comment_lines(text: str, indent: str = "") -> list[str]:
    """`text` as comment lines of at most 110 characters, each after `# ` and `indent`."""
    return textwrap.wrap(
        text, 110, initial_indent="# " + indent, subsequent_indent="# " + indent, break_on_hyphens=False
    )

"""The documentation is a site (mkdocs.yml over docs/) and the README stays an entry point into it.

The configuration reference in docs/configuration.md is the schema's rendering; every page is in the site's
navigation; the site builds in strict mode (a broken link, a missing anchor or a page left out fails it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import config_reference

REPO = Path(__file__).resolve().parents[1]


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_configuration_reference_is_the_schemas_rendering():
    page = config_reference.PAGE.read_text()
    assert config_reference.rendered_page(page) == page, "run `python -m scripts.config_reference`"


def test_the_reference_lists_every_key_of_every_section():
    from trainer.config.schema import section_classes

    page = config_reference.PAGE.read_text()
    for section, cls in section_classes().items():
        assert f"### {section}\n" in page
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f.name


def test_a_stale_reference_is_reported_and_the_check_fails(tmp_path, monkeypatch):
    stale = tmp_path / "configuration.md"
    page = config_reference.PAGE.read_text()
    stale.write_text(page.replace("| `steps` |", "| `stepz` |"))
    monkeypatch.setattr(config_reference, "PAGE", stale)
    monkeypatch.setattr(config_reference, "REPO", tmp_path)
    assert config_reference.main(["--check"]) == 1
    assert config_reference.main([]) == 0 and stale.read_text() == page


def test_every_page_is_in_the_navigation_and_every_navigation_entry_is_a_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))


def test_the_readme_is_an_entry_point_that_links_every_page_it_names():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / target).is_file(), target


@pytest.mark.docs
@pytest.mark.timeout(600)
def test_the_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]"')
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()

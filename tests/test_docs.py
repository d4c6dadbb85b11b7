"""The documentation that is generated from code must be current."""

from __future__ import annotations

from pathlib import Path

from gazctl.reference import full

ROOT = Path(__file__).resolve().parents[1]


def test_gazctl_reference_is_current() -> None:
    committed = (ROOT / "docs" / "gazctl.md").read_text()
    assert committed == full(), (
        "docs/gazctl.md is stale: python -m gazctl.reference > docs/gazctl.md"
    )


def test_readme_quick_start_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "nox -s demo" in readme and "nox -s tests" in readme
    assert "nox -s tests" in (ROOT / ".ci" / "run").read_text()

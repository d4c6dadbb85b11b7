"""The documentation site (mkdocs.yml: the guides and the API reference generated from the
docstrings) builds strict, warnings as errors, as `nox -s docs` builds it; and the guide's
worked example is the test module that runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict_with_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    # The reference holds the documented names, not only its headings.
    pages = {
        "reference/consumer/index.html": ["ConsumerApplication", "new_store", "serve_command"],
        "reference/stores/index.html": ["JSONFileStore", "SQLStore", "SQLiteStore", "FencedOut"],
        "reference/broker-client/index.html": ["JournalsClient", "AppendService", "Router"],
        "reference/message/index.html": ["Publisher", "read_committed", "DictMessages"],
        "reference/testing/index.html": [
            "gazette_broker", "gazette_consumers", "gazette_consumer_processes", "ConsumerGroup",
            "create_journals", "read_committed_messages", "BrokerHarness",
        ],
    }  # fmt: skip
    for page, names in pages.items():
        html = (site / page).read_text()
        missing = [name for name in names if name not in html]
        assert not missing, f"{page} lacks {missing}"
    assert (site / "applications" / "index.html").exists()


def test_the_guide_quotes_its_worked_example_as_it_runs() -> None:
    guide = (ROOT / "docs" / "applications.md").read_text()
    example = (ROOT / "tests" / "test_application_guide.py").read_text()
    assert f"```python\n{example}```\n" in guide, (
        "docs/applications.md must quote tests/test_application_guide.py whole"
    )

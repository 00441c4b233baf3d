"""Every alert has its runbook: docs/runbooks/<alert>.md with the four sections, linked by its
runbook_url and listed, with its severity, in the runbooks' index."""

from __future__ import annotations

import re

import pytest
from deploy_harness import RUNBOOKS, alerts

SECTIONS = ["Meaning", "Impact", "Diagnosis", "Mitigation"]
RUNBOOK_URL = re.compile(r"^https://\S+/docs/runbooks/(?P<name>[A-Za-z]+)\.md$")


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_the_alert_links_its_runbook_with_the_four_sections(alert: dict) -> None:
    name = alert["alert"]
    match = RUNBOOK_URL.match(alert["annotations"]["runbook_url"])
    assert match and match["name"] == name, f"{name}: runbook_url does not name its runbook"
    page = RUNBOOKS / f"{name}.md"
    assert page.is_file(), f"{name}: no runbook at {page}"
    text = page.read_text()
    assert text.startswith(f"# {name}\n"), f"{page}: the title is not the alert's name"
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert headings == SECTIONS, f"{page}: sections {headings}, expected {SECTIONS}"
    for section in re.split(r"^## .+$", text, flags=re.MULTILINE)[1:]:
        assert section.strip(), f"{page}: an empty section"


def test_the_index_lists_every_alert_with_its_severity_and_no_other_page() -> None:
    index = dict(
        re.findall(
            r"^\| \[(\w+)\]\(\1\.md\) \| (\w+) \|$",
            (RUNBOOKS / "README.md").read_text(),
            re.MULTILINE,
        )
    )
    assert index == {a["alert"]: a["labels"]["severity"] for a in alerts()}
    pages = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    assert pages == set(index), "a runbook without an alert, or an alert without a runbook"

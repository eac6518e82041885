"""The README is a front page and every page it links to exists: no broken link or image."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, (
        f"README.md has {len(lines)} lines; move reference material into docs/"
    )
    text = "\n".join(lines)
    for term in (
        "Step A",
        "transductive split",
        "discrepancy score",
        "AUROC",
        "FPR95",
        "MSP",
        "ODIN",
        "OpenOOD",
    ):
        first_use = text.index(term)
        assert text.index(f"**{term}**") + 2 == first_use, f"{term!r} is used before it is defined"


def answer_block(text: str) -> str:
    """The project's answer: the text between its two markers (docs/answer.md is its home)."""
    begin, end = "<!-- answer:begin -->", "<!-- answer:end -->"
    assert text.count(begin) == text.count(end) == 1, "the answer's markers, once each"
    return text.split(begin)[1].split(end)[0]


def test_the_answer_is_said_the_same_way_everywhere():
    # one home, docs/answer.md: the README shows it as it is; notebooks 02 and 08 render the file
    answer = answer_block((ROOT / "docs" / "answer.md").read_text())
    assert answer_block((ROOT / "README.md").read_text()) == answer
    for stem in ("02_concat_vs_separate", "08_protocols_and_strategies"):
        cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        assert any('"docs" / "answer.md"' in c and "Markdown(" in c for c in code), stem


def test_every_relative_link_and_image_exists():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    assert len(PAGES) >= 7


def test_licence_and_citation_are_there():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    import yaml  # CITATION.cff is YAML (Citation File Format 1.2.0)

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert cff["preferred-citation"]["year"] == 2019

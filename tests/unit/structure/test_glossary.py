"""docs/design.md's glossary: it defines the words the design leans on (the ones a newcomer trips on
included), each in one row, and every place a row points at exists (files, and the names in them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DESIGN = ROOT / "docs" / "design.md"
# Words the design and the code use that once had no definition or more than one meaning (issue 43).
MUST_DEFINE = ("agreement", "block", "layout", "level", "lowering", "needs", "needs-only", "plan", "ring length",
               "room", "schedule", "seat", "source", "strategy", "traffic", "transport", "trust key", "verdict")


def _rows() -> dict[str, tuple[str, str]]:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("term", "---"):
            term = cells[0]
            assert term not in rows, f"glossary defines {term!r} twice"
            rows[term] = (cells[1], cells[2])
    return rows


def _exists(path: str) -> bool:
    return any((base / path).exists() for base in (ROOT, ROOT / "cp_attention", ROOT / "integrations"))


def test_the_glossary_defines_the_designs_words():
    rows = _rows()
    missing = [w for w in MUST_DEFINE if not any(w == re.sub(r"\s*\(.*\)$", "", t).strip("`") for t in rows)]
    assert not missing, f"docs/design.md's glossary does not define {missing}"


def test_every_pointer_exists():
    """Each file a row names exists, and each name it gives in parentheses is in that file (or its room)."""
    bad = []
    for term, (_, where) in _rows().items():
        for place, names in re.findall(r"`([\w/]+\.py)`(?: \(([^)]*)\))?", where):
            if not _exists(place):
                bad.append(f"{term}: {place}")
                continue
            source = next((b / place) for b in (ROOT, ROOT / "cp_attention", ROOT / "integrations")
                          if (b / place).exists()).read_text(encoding="utf-8")
            for name in re.findall(r"`([\w.]+)`", names or ""):
                if not re.search(rf"\b{re.escape(name.split('.')[-1])}\b", source):
                    bad.append(f"{term}: {name} not in {place}")
    assert not bad, bad

"""What the package, its docs and its benchmarks cite can be followed from the repository: papers by title, arXiv id
and section or equation, and docs that exist. Never a document outside the repository (the implementation notes
``specs/<paper>.md`` and their section and ambiguity numbers, ``DESIGN.md``, ``../shared/...``) nor an issue number.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OUTSIDE = re.compile(r"""
      (?i:\bspecs?(?:'s)?\s*§)            # spec §2.7, the spec's §4.2
    | (?i:\bspec(?:'s)?\s+[AC]\d+\b)      # spec A8, Spec A6 erratum, spec C11
    | \bspecs/\w+\.md                     # specs/ssf.md
    | \.\./shared\b | \bshared/(?:specs|seeds|data|research)\b
    | \bDESIGN(?:\.md)?\s*§ | \bDESIGN\.md\b
    | (?i:\bissues?\s+\#?\d+)             # issue #16, issue 17
""", re.X)


DOC = re.compile(r"""\bdocs/([\w/.-]+\.md)(?:,\s*"([^"]+)")?""")


def cited_files():
    """Every text file of the package, the docs and the benchmarks: ``(path relative to the checkout, text)``."""
    paths = [*(ROOT / "src" / "fedlowrank").rglob("*.py"), *(ROOT / "src" / "fedlowrank").rglob("*.toml"),
             *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").glob("*.py")]
    assert len(paths) > 100
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in sorted(paths)]


def test_nothing_cites_a_document_outside_the_repository_or_an_issue():
    found = {}
    for path, text in cited_files():
        for n, line in enumerate(text.splitlines(), 1):
            m = OUTSIDE.search(line)
            if m:
                found.setdefault(path, []).append(f"{path}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    hits = [hit for path_hits in found.values() for hit in path_hits]
    assert not hits, "cite the paper (title, arXiv id, §/eq.) or a docs/ section instead:\n" + "\n".join(hits)


def test_the_pattern_catches_each_form_and_spares_ordinary_text():
    for cited in ("spec §2.7", "the spec's §4.2", "FLoRG spec A12", "Spec A6 erratum", "(spec C11)", "specs/ssf.md §6.1",
                  "../shared/data/agnews", "shared/specs/ilora.md", "DESIGN §3", "DESIGN.md", "issue #16", "issue 17"):
        assert OUTSIDE.search(cited), cited
    for plain in ("load_model(spec, kind)", "column_spec(c)", "spec[len(PREFIX):]", "arXiv:2604.25467 §5.1",
                  "the shared seed", "scaffold.ci/<key>", "App. A.1", "ziyaow1010/FederatedLLM#16", "a design choice"):
        assert not OUTSIDE.search(plain), plain


def test_cited_docs_and_their_sections_exist():
    missing = []
    for path, text in cited_files() + [("README.md", (ROOT / "README.md").read_text(encoding="utf-8"))]:
        for m in DOC.finditer(text):
            doc = ROOT / "docs" / m.group(1)
            if not doc.is_file():
                missing.append(f"{path}: docs/{m.group(1)}")
            elif m.group(2) and not any(line.startswith("#") and m.group(2) in line
                                        for line in doc.read_text(encoding="utf-8").splitlines()):
                missing.append(f'{path}: docs/{m.group(1)}, "{m.group(2)}" (no such heading)')
    assert not missing, "\n".join(missing)

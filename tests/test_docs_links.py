"""The repository cites only documents it contains: every Markdown link to a local file resolves
(with its `#anchor`, for Markdown targets), and every `*.md` file named in a tracked source,
config or page exists in the tree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")             # [text](target)
MD_NAME = re.compile(r"(?<![\w{}/.-])([\w./-]*\w\.md)\b")  # docs/DESIGN.md, REPORT.md, ../x/y.md


def tracked_files(root: Path = ROOT) -> list[Path]:
    """Files under version control, and new ones git does not ignore (every file but .git's, outside
    a checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True, timeout=30, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*") if ".git" not in p.parts and p.is_file()]
    return [root / n for n in names if n.endswith(SUFFIXES) and (root / n).is_file()]


def slug(heading: str) -> str:
    """The anchor a Markdown heading gets on GitHub."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.M)}


def broken_references(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file:line: what' for each reference to a document the tree does not hold."""
    names = {p.name for p in files}
    bad = []
    for path in files:
        rel = path.relative_to(root)
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if path.suffix == ".md":
                for target in LINK.findall(line):
                    if re.match(r"[a-z]+:", target):             # http:, https:, mailto:
                        continue
                    file, _, anchor = target.partition("#")
                    page = (path.parent / file).resolve() if file else path
                    if not page.exists():
                        bad.append(f"{rel}:{no}: link to {target!r}, which the repository does not hold")
                    elif anchor and page.suffix == ".md" and anchor not in anchors(page):
                        bad.append(f"{rel}:{no}: link to {target!r}: {page.name} has no heading #{anchor}")
                line = LINK.sub("", line)                             # checked above
            for name in MD_NAME.findall(line):
                found = (root / name).exists() or (path.parent / name).exists() if "/" in name else name in names
                if not found:
                    bad.append(f"{rel}:{no}: names {name!r}, which the repository does not hold")
    return bad


def test_every_cited_document_is_in_the_repository():
    files = [p for p in tracked_files() if p != Path(__file__).resolve()]   # this file plants references
    assert any(p.name == "DESIGN.md" for p in files), "docs/DESIGN.md is the design page the code cites"
    bad = broken_references(files)
    assert not bad, "references to documents outside the repository:\n" + "\n".join(bad)


def test_a_planted_reference_is_caught(tmp_path):
    """The check itself: a page that cites a missing document, a missing file and a missing heading."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("# A page\n\n## Its part\n")
    page = tmp_path / "B.md"
    page.write_text("See [the page](docs/A.md#its-part) and NOTES.md.\n[gone](docs/C.md) [part](docs/A.md#nope)\n")
    code = tmp_path / "m.py"
    code.write_text('"""As docs/A.md says; and as ../outside/GUIDE.md says."""\n')
    bad = broken_references([tmp_path / "docs" / "A.md", page, code], tmp_path)
    assert len(bad) == 4, bad
    assert "B.md:1: names 'NOTES.md'" in bad[0] and "docs/C.md" in bad[1] and "#nope" in bad[2]
    assert "m.py:1: names '../outside/GUIDE.md'" in bad[3]


def test_design_page_names_the_public_api_that_exists():
    """Every `from X import names` of docs/DESIGN.md's Python blocks imports: the page's API list is
    the package's, and a renamed public name fails here."""
    import importlib

    text = (ROOT / "docs" / "DESIGN.md").read_text()
    lines = [line for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
             for line in block.splitlines() if line.startswith("from ")]
    assert len(lines) >= 5, lines
    for line in lines:
        module, names = re.match(r"from ([\w.]+) import ([\w, ]+)", line).groups()
        mod = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(mod, n.strip())]
        assert not missing, f"docs/DESIGN.md: {module} has no {missing}"

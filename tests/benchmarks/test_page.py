"""benchmarks/README.md holds current figures only, one table per target (the page's own
rules, stated in its first paragraph): every ``##`` section is exactly one table with the
columns figure, target, commit, command, link; no history words; a line cap; the commit is a
hash and the link names a dated result file that exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "benchmarks" / "README.md"
COLUMNS = ["figure", "target", "commit", "command", "link"]


def _sections() -> dict[str, list[str]]:
    out, title = {}, None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:]
            out[title] = []
        elif title is not None and line.strip():
            out[title].append(line)
    return out


def test_page_is_short_and_has_no_history_words():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 300
    for word in ("superseded", "not yet re-run", "now"):
        assert not re.search(rf"\b{word}\b", text, re.I), word


def test_every_target_section_is_one_table_with_the_five_columns():
    sections = _sections()
    assert len(sections) >= 10
    for title, lines in sections.items():
        assert all(line.startswith("|") for line in lines), f"{title}: text beside its table"
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        if title == "Method":
            continue
        assert header == COLUMNS, (title, header)
        assert len(lines) == 3, f"{title}: one row per target"
        row = [c.strip() for c in lines[2].strip("|").split("|")]
        assert re.fullmatch(r"[0-9a-f]{7,40}", row[2]), (title, row[2])
        target = re.search(r"\]\(([^)#]+)", row[4]).group(1)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[\w-]+_[\w-]+\.md", target), target
        assert (PAGE.parent / target).is_file(), target


def test_dated_result_files_are_named_by_date_machine_and_topic():
    for path in PAGE.parent.glob("*.md"):
        if path.name != "README.md":
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9-]+_[\w-]+\.md", path.name), path.name

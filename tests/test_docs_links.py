"""The docs stand alone: every relative link resolves inside the repository, and nothing cites
the outside design page.

Checked:
* every relative link ``[text](target)`` in README.md and docs/**/*.md (outside code) names an
  existing file or folder, and a ``#anchor`` on a Markdown target names one of its headings
  (GitHub's heading ids);
* every ``docs/<page>.md#anchor`` pointer written in a source comment or docstring resolves the
  same way;
* no file names a folder beside the checkout, or a document inside one (material outside the
  repository, which a reader of the repository does not have).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("k3train", "moe", "optim", "pipeline", "scripts", "configs")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_EXPLICIT_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_SOURCE_POINTER = re.compile(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?")


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (what a checkout holds)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=ROOT, capture_output=True, check=True).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", "runs"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def slug(heading: str) -> str:
    """GitHub's id for a heading: markup dropped, lower case, punctuation removed, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text())
    ids, seen = set(), {}
    for h in _HEADING.findall(text):
        base = slug(h)
        n = seen.get(base, 0)
        ids.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return ids | set(_EXPLICIT_ID.findall(text))


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def check_target(base: Path, target: str, where: str) -> str | None:
    """None when ``target`` (a path relative to ``base``, optionally with #anchor) resolves."""
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve() if path else None
    if dest is not None:
        if not dest.is_relative_to(ROOT):
            return f"{where}: {target} points outside the repository"
        if not dest.exists():
            return f"{where}: {target} does not exist"
    if anchor:
        page = dest if dest is not None else None
        if page is None or page.suffix != ".md" or page.is_dir():
            return None if page is not None else f"{where}: {target} has no page"
        if anchor not in anchors(page):
            return f"{where}: {target}: no heading with id #{anchor} in {page.relative_to(ROOT)}"
    return None


def test_slug_follows_github_rules():
    assert slug("4. The trainer step (`k3train/trainer/state.py`, `loop.py`)") == \
        "4-the-trainer-step-k3traintrainerstatepy-looppy"
    assert slug("Correctness on the GPU (fla kernels) — passed") == "correctness-on-the-gpu-fla-kernels--passed"
    assert slug("Dense model against fla's") == "dense-model-against-flas"


def test_every_relative_link_in_the_docs_resolves():
    problems, checked = [], 0
    for md in markdown_files():
        text = _INLINE_CODE.sub("", _FENCE.sub("", md.read_text()))
        for target in _LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            where = str(md.relative_to(ROOT))
            if target.startswith("#"):
                problem = check_target(md.parent, md.name + target, where)
            else:
                problem = check_target(md.parent, target, where)
            if problem:
                problems.append(problem)
    assert checked > 50, f"only {checked} links found: the link pattern is broken"
    assert not problems, "\n".join(problems)


def test_docs_pointers_in_source_resolve():
    problems, checked = [], 0
    for f in repo_files():
        rel = f.relative_to(ROOT)
        if rel.parts[0] not in SOURCE_DIRS or f.suffix not in (".py", ".sh", ".yaml", ".toml"):
            continue
        for path, anchor in _SOURCE_POINTER.findall(f.read_text(errors="replace")):
            checked += 1
            problem = check_target(ROOT, path + (f"#{anchor}" if anchor else ""), str(rel))
            if problem:
                problems.append(problem)
    assert checked > 5, f"only {checked} pointers found: the pointer pattern is broken"
    assert not problems, "\n".join(problems)


def _outside_names() -> set[str]:
    """What a file could cite outside the repository: ``../NAME`` for each folder beside the
    checkout, and the documents at the top of those folders. Read from the disk, so the names
    themselves are written nowhere in the repository."""
    home = ROOT
    # .ci/run tests a clone in a temporary folder: look beside the checkout it was cloned from.
    origin = subprocess.run(["git", "-C", str(ROOT), "config", "--get", "remote.origin.url"],
                            capture_output=True, text=True).stdout.strip()
    if origin and Path(origin).is_dir():
        home = Path(origin).resolve()
    names = set()
    for sibling in home.parent.iterdir():
        if sibling.resolve() in (home, ROOT) or not sibling.is_dir() or sibling.name.startswith("."):
            continue
        if (sibling / ".git").exists():  # another checkout or worktree of a repository, not material
            continue
        names.add(f"../{sibling.name}/")
        names.update(f.name for f in sibling.glob("*.md"))
    # a document name the repository itself has at its top (README.md) cites nothing outside it
    return names - {f.name for f in ROOT.glob("*.md")}


def test_nothing_cites_material_outside_the_repository():
    needles = _outside_names()
    hits = []
    for f in repo_files():
        rel = f.relative_to(ROOT)
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # images and other binary files
        hits += [f"{rel}: mentions {n}" for n in sorted(needles) if n in text]
    assert not hits, "\n".join(hits)

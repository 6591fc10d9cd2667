"""docs/architecture.md names every module of forwardpass/ (its module map); every doc page is linked."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_architecture_doc_names_every_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "forwardpass"
    modules = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))]
    missing = [m for m in modules if not m.endswith("__init__.py") and f"`{m}`" not in doc]
    assert not missing, f"add these modules to docs/architecture.md's module map: {missing}"


def test_every_doc_page_is_reachable_from_the_readme():
    """Pages link to pages; every docs/*.md is reached from README.md by following links."""
    import re

    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists():
            continue
        seen.add(page)
        links = r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)|^\[[^]]+\]:\s*(\S+\.md)"  # inline, reference-style
        for inline, reference in re.findall(links, page.read_text(), re.M):
            todo.append((page.parent / (inline or reference)).resolve())
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert not pages - seen, f"doc pages no link reaches: {sorted(p.name for p in pages - seen)}"

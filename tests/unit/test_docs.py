"""The documentation: README.md is the front page, docs/ the pages, built by MkDocs. The strict build
fails on a broken link or anchor and on a page left out of the nav (mkdocs.yml's `validation`), and
the README's links reach every page."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = next(p for p in Path(__file__).resolve().parents if (p / "mkdocs.yml").is_file())
DOCS = REPO / "docs"


def require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        missing = "mkdocs is not installed: pip install -c requirements/constraints.txt -e '.[test]'"
        if os.environ.get("CI") == "true":  # the test extra installs it; a skip there would hide a broken page
            pytest.fail(missing)
        pytest.skip(missing)


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


def nav_pages(config: Path) -> list[str]:
    nav = yaml.safe_load(config.read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


def test_the_site_builds_strictly_with_every_page(tmp_path):
    require_mkdocs()
    proc = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in sorted(DOCS.glob("*.md")):
        built = tmp_path / "site" / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built"


@pytest.mark.parametrize("break_it, message", [
    (lambda docs: (docs / "orphan.md").write_text("# Orphan\n"), "orphan.md"),
    (lambda docs: (docs / "lora.md").open("a").write("\nSee [the gone page](gone.md).\n"), "gone.md"),
    (lambda docs: (docs / "lora.md").open("a").write("\nSee [a gone section](packing.md#no-such-heading).\n"),
     "no-such-heading"),
], ids=["page-missing-from-nav", "broken-link", "broken-anchor"])
def test_the_strict_build_fails_on(break_it, message, tmp_path):
    """The check above is worth something only if the build refuses these (mkdocs' defaults let a page
    missing from the nav and a broken anchor through as INFO lines)."""
    require_mkdocs()
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    break_it(tmp_path / "docs")
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_readme_links_every_page_and_nothing_missing():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    missing = [t for t in local if not (REPO / t).exists()]
    assert missing == [], f"README.md links to missing files: {missing}"
    unlinked = [page for page in nav_pages(REPO / "mkdocs.yml") if f"docs/{page}" not in local]
    assert unlinked == [], f"README.md does not link these pages of the nav: {unlinked}"


REPO_ROOTS = ("toolkit/", "tests/", "benchmarks/", "examples/", "docker/", "ds_configs/", "megatron_configs/",
              "requirements/", ".ci/")


def named_paths(text: str) -> list[str]:
    """Repository paths named in code: fenced blocks and inline spans (globs and placeholders left out)."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.DOTALL))
    tokens = [tok.split("::")[0].rstrip(".:") for code in fenced + inline for tok in re.split(r"[\s,;()\"'\[\]]+", code)]
    return [tok for tok in tokens if tok.startswith(REPO_ROOTS) and not any(c in tok for c in "*{<$")]


def test_every_path_the_docs_name_exists():
    """A file moved or renamed leaves no page pointing at its old place (135 paths when written)."""
    stale = {page.name: missing for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
             if (missing := [path for path in named_paths(page.read_text()) if not (REPO / path).exists()])}
    assert stale == {}, f"the docs name paths that do not exist: {stale}"


def test_the_readme_two_commands_are_makefile_targets():
    """CI (.ci/run) runs the README's test command; the README names the two commands a fresh machine needs."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make demo", "make test"], commands
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"Makefile has no `{target}` target"
    assert "make test" in (REPO / ".ci" / "run").read_text()

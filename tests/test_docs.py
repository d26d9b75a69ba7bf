"""The README front page and the docs site: the site builds (``mkdocs build --strict``), every internal
link of the site and of README.md resolves, anchors included, and the diagnosis shown is the demo's own."""

from __future__ import annotations

import html.parser
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from nanguard.cli import main

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


class _Page(html.parser.HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if named.get("id"):
            self.ids.add(str(named["id"]))
        for key in ("href", "src"):
            if named.get(key) and tag in ("a", "img", "link", "script"):
                self.links.append(str(named[key]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _broken_site_links(site: Path) -> list[str]:
    # 404.html is served at any depth, so its links are absolute paths under the site's root URL.
    pages = {p: _parse(p) for p in site.rglob("*.html") if p.name != "404.html"}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("mailto:"):
                continue
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    return broken


def test_docs_site_builds_strict_and_every_internal_link_resolves(tmp_path: Path) -> None:
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "index.html").exists() and (site / "causes" / "index.html").exists()
    assert _broken_site_links(site) == []


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="x">x</h2><a href="#x">ok</a><a href="../b/">gone</a>')
    (tmp_path / "index.html").write_text('<a href="a/#x">ok</a><a href="a/#y">no anchor</a>')
    assert sorted(_broken_site_links(tmp_path)) == [
        "a/index.html: ../b/ (no such file)",
        "index.html: a/#y (no such anchor)",
    ]


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets on a code host and in mkdocs' toc (the same for our headings)."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _broken_markdown_links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for link in LINK.findall(text):
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue
        target = (md.parent / parts.path).resolve() if parts.path else md
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in _anchors(target):
            broken.append(f"{link} (no such anchor)")
    return broken


def test_readme_links_resolve() -> None:
    readme = ROOT / "README.md"
    links = LINK.findall(readme.read_text(encoding="utf-8"))
    assert any(link.startswith("docs/") for link in links)
    assert _broken_markdown_links(readme) == []
    assert _broken_markdown_links(ROOT / "tests" / "README.md") == []


def test_the_slugs_are_the_sites() -> None:
    assert _slug("A loop guarded where it stands: `LoopGuard`") == "a-loop-guarded-where-it-stands-loopguard"
    assert _slug("`Guard.step_accumulated`") == "guardstep_accumulated"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    top = "\n".join(lines[:10])
    assert "make demo" in top and "make test" in top
    # The package is not on the package index: every install line says where it comes from.
    installs = [line for line in lines if "pip install" in line]
    assert installs and all("./nanguard" in line or "git+" in line for line in installs), installs
    text = "\n".join(lines)
    for entry in ("ng.locate", "guard.step(", "step_accumulated", "LoopGuard", "guard.check(", "NanGuard()"):
        assert entry in text, entry
    assert "NanGuardCallback" in text and "FabricGuard" in text


def _diagnosis_blocks(md: Path) -> list[str]:
    return re.findall(r"```text\n(nanguard: \w+ created.*?)```", md.read_text(encoding="utf-8"), flags=re.S)


def _comparable(block: str) -> list[str]:
    """The block's lines with what depends on the machine left out: the checkout's path, the host name
    and the digits of a float (the CPU's rounding may move the last ones)."""
    lines = []
    for line in block.rstrip().splitlines():
        line = re.sub(r"\S*(src/nanguard/)", r"\1", line)
        line = re.sub(r"^(  host\s+)\S+", r"\1HOST", line)
        lines.append(re.sub(r"-?\d+\.\d+", "#", line.rstrip()))
    return lines


def test_the_diagnosis_shown_is_what_the_demo_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--no-run-dir"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if "headroom checks stop" in line]  # a float32 run's non-news stays quiet
    start = max(i for i, line in enumerate(out) if re.match(r"nanguard: \w+ created - ", line))
    end = start + 1
    while end < len(out) and out[end].startswith("  "):
        end += 1
    printed = _comparable("\n".join(out[start:end]))
    for page in (ROOT / "README.md", ROOT / "docs" / "locate.md"):
        blocks = _diagnosis_blocks(page)
        assert blocks, page
        for block in blocks:
            assert _comparable(block) == printed, page


def test_the_zoo_counts_on_the_zoo_page_are_the_zoos() -> None:
    from nanguard.zoo import SCENARIOS
    from nanguard.zoo.runner import WILD

    text = " ".join((ROOT / "docs" / "zoo.md").read_text(encoding="utf-8").split())
    single = [s for s in SCENARIOS if s.ranks == 1]
    healthy = [s for s in single if s.expect.cause is None]
    said = re.search(
        r"(\d+) faulty single-process scenarios, (\d+) healthy ones, (\d+) distributed ones and (\d+) wild", text
    )
    assert said is not None
    # A scenario added or removed: update the counts in docs/zoo.md's first sentence (and "rebuilds N NaN bugs").
    assert tuple(map(int, said.groups())) == (
        len(single) - len(healthy),
        len(healthy),
        len(SCENARIOS) - len(single),
        len(WILD),
    )
    assert f"rebuilds {len(WILD)} NaN bugs" in text


def test_the_zoo_comparison_text_is_its_recorded_run() -> None:
    """BENCHMARKS.md's zoo comparison is written by benchmarks/zoo_compare.py: the counts its text and the
    "At a glance" line state are the rows of the run it recorded."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    section = text.split("<!-- zoo-compare -->", 1)[1].split("<!-- /zoo-compare -->", 1)[0]
    gpt, healthy, wild = map(
        int, re.search(r"(\d+) tiny-GPT scenarios \((\d+) healthy\) and (\d+) wild", section).groups()
    )
    per_scenario = section.split("Per scenario", 1)[1]
    rows = re.findall(r"^\| (gpt|wild) \| [a-z0-9_]+[^|]* \| [a-z_.]+ \| ([^|]*) \|", per_scenario, flags=re.M)
    assert ([g for g, _ in rows].count("gpt"), [g for g, _ in rows].count("wild")) == (gpt, wild)
    # The format, not the result: the summary's nanguard cell counts the scenario rows it detected.
    found = {g: sum(cell.strip().startswith("detected") for group, cell in rows if group == g) for g in ("gpt", "wild")}
    assert (
        f"| gpt | nanguard | {found['gpt']}/{gpt - healthy} |" in section
        and f"| wild | nanguard | {found['wild']}/{wild} |" in section
    )
    glance = " ".join(text.split("<!-- locate-cost -->", 1)[0].split())
    assert f"{gpt} tiny-GPT scenarios, {healthy} of them healthy, and {wild} wild ones" in glance
    assert "hooks removed from each tiny-GPT block and its attention module" in glance


def test_each_benchmarks_table_has_one_line_of_conditions_above_it() -> None:
    """BENCHMARKS.md's convention (the scripts in benchmarks/ write it so): a table's conditions are one line
    right above it; what else a section says comes after its tables."""
    lines = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")]
    assert len(starts) > 10
    for i in starts:
        blank, conditions, above = lines[i - 1], lines[i - 2], lines[i - 3]
        one_line = not blank and conditions.strip() and (not above.strip() or above.startswith(("#", "<")))
        assert one_line, f"BENCHMARKS.md line {i + 1}: not one line of conditions above the table: {lines[i - 3 : i]}"

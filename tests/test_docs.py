"""The README and docs/ (issue 24, point 5): the README stays a newcomer's page of at most 250
lines with the two commands exactly as CI and users run them, every docs/ page is reachable from
it, and no intra-repo link is broken: a relative link names a file or directory that exists, and
its `#anchor` names a heading of the target page (GitHub's anchor rules), and a repository path
in a code span exists; docs/cli.md's option tables name exactly the options each command has.

The checker works on any tree (`check_tree(root)`), so its own tests build small broken trees and
require it to report them."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
# The two commands of the README's "Two commands" section, each the whole line of a bash block.
TWO_COMMANDS = (
    "bash deploy/setup.sh && .venv/bin/moestream demo",
    ".venv/bin/python -m pytest -q",
)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text: markup dropped (code spans keep their text,
    links their label), lower-cased, every character that is not a letter, digit, '_', '-' or
    space removed, spaces turned into '-'. Repeats are numbered by `anchors_of`."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = LINK.sub(lambda m: m.group(2), text)
    text = re.sub(r"[*_]{1,3}(\S(?:.*?\S)?)[*_]{1,3}", r"\1", text)  # emphasis markers
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LN" or cat == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    in_fence = False
    for no, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield no, line


def anchors_of(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links_of(text: str):
    """(line number, target) of every inline link or image outside code blocks and code spans."""
    for no, line in _prose_lines(text):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield no, m.group(3)


def _pages(root: Path) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def check_tree(root: Path, written_elsewhere=frozenset()) -> list[str]:
    """Problems with the links of README.md and docs/*.md under `root`, one line each."""
    problems = []
    anchor_cache: dict[Path, set[str]] = {}

    def anchors(path: Path) -> set[str]:
        if path not in anchor_cache:
            anchor_cache[path] = anchors_of(path.read_text(encoding="utf-8"))
        return anchor_cache[path]

    root = root.resolve()
    for page in _pages(root):
        if not page.exists():
            problems.append(f"{page.relative_to(root)}: missing")
            continue
        where = page.relative_to(root)
        for no, target in links_of(page.read_text(encoding="utf-8")):
            if not target or EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if root not in dest.parents and dest != root:
                problems.append(f"{where}:{no}: {target} leaves the repository")
                continue
            rel = dest.relative_to(root).as_posix()
            if not dest.exists():
                if rel in written_elsewhere and not anchor:
                    continue
                problems.append(f"{where}:{no}: {target}: no such file or directory")
                continue
            if anchor:
                if dest.is_dir() or dest.suffix != ".md":
                    problems.append(f"{where}:{no}: {target}: an anchor into a non-Markdown target")
                elif anchor not in anchors(dest):
                    problems.append(f"{where}:{no}: {target}: no heading with anchor #{anchor}")
    return problems


CODE_PATH = re.compile(r"^(?:engine|services|bench|tests|deploy|protocol)/[^\s]*$")


def missing_code_paths(root: Path) -> list[str]:
    """Repository paths named in code spans (`engine/step.py`, `tests/x.py::test_y`) that do not
    exist; placeholders (`<arch>`), globs and brace lists are not paths and are skipped."""
    root = root.resolve()
    problems = []
    for page in _pages(root):
        for no, line in _prose_lines(page.read_text(encoding="utf-8")):
            for m in INLINE_CODE.finditer(line):
                path = m.group(2).split("::")[0].split()[0] if m.group(2).strip() else ""
                if not CODE_PATH.match(path) or any(c in path for c in "<>{}*?$"):
                    continue
                if not (root / path).exists():
                    problems.append(f"{page.relative_to(root)}:{no}: `{path}` does not exist")
    return problems


def unreachable_pages(root: Path) -> list[str]:
    """docs/*.md pages no chain of links from README.md reaches."""
    root = root.resolve()
    start = root / "README.md"
    seen, todo = {start}, [start]
    while todo:
        page = todo.pop()
        for _, target in links_of(page.read_text(encoding="utf-8")):
            path_part = target.partition("#")[0]
            if not path_part or EXTERNAL.match(target):
                continue
            dest = (page.parent / path_part).resolve()
            if dest.suffix == ".md" and dest.is_file() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    return [p.relative_to(root).as_posix() for p in sorted((root / "docs").glob("*.md"))
            if p.resolve() not in seen]


def _bash_block_lines(text: str) -> list[str]:
    lines, in_bash = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            in_bash = (not in_bash) and line.strip() in ("```bash", "```sh")
            continue
        if in_bash:
            lines.append(line)
    return lines


# ---- the repository -------------------------------------------------------------------------

def test_readme_is_at_most_250_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to a docs/ page"


def test_readme_has_the_two_commands_verbatim():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Two commands" in text.split("\n")
    bash = _bash_block_lines(text)
    for command in TWO_COMMANDS:
        assert command in bash, f"README.md lacks the command line {command!r} in a bash block"


def test_no_broken_intra_repo_links():
    problems = check_tree(ROOT, frozenset())
    assert not problems, "\n".join(problems)


def test_repository_paths_in_code_spans_exist():
    problems = missing_code_paths(ROOT)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme():
    assert list((ROOT / "docs").glob("*.md")), "docs/ holds no page"
    missing = unreachable_pages(ROOT)
    assert not missing, f"not linked from README.md (directly or through a linked page): {missing}"


def test_the_readme_links_the_architecture_guide():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = {t.partition("#")[0] for _, t in links_of(text)}
    assert "docs/adding-an-architecture.md" in targets


def documented_options(cli_md: str) -> dict[tuple[str, ...], set[str]]:
    """docs/cli.md's "Options by command": for each `### `moestream CMD` ...` heading (several
    commands may share one), the options named in the first cell of its tables' rows."""
    sections: dict[tuple[str, ...], set[str]] = {}
    current = None
    for _, line in _prose_lines(cli_md):
        if line.startswith("## "):
            current = None
        elif line.startswith("### `moestream "):
            spans = [m.group(2) for m in INLINE_CODE.finditer(line)]
            current = tuple(span.removeprefix("moestream ").split()[0] for span in spans)
            sections[current] = set()
        elif current is not None and line.startswith("| `--"):
            first_cell = line.split("|")[1]
            for span in INLINE_CODE.finditer(first_cell):
                for opt in span.group(2).split("/"):
                    sections[current].add(opt.strip())
    return sections


def test_cli_reference_lists_every_option_of_every_command():
    import click

    from services.cli import main

    sections = documented_options((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    covered = [name for names in sections for name in names]
    assert sorted(covered) == sorted(main.commands), "docs/cli.md: one options section per command"
    for names, documented in sections.items():
        actual = {opt for name in names for p in main.commands[name].params
                  if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts if opt.startswith("--")}
        actual.discard("--help")
        assert documented == actual, (f"docs/cli.md, {' / '.join(names)}: undocumented "
                                      f"{sorted(actual - documented)}, not options {sorted(documented - actual)}")


# ---- the checker itself ---------------------------------------------------------------------

@pytest.mark.parametrize("heading, anchor", [
    ("Two commands", "two-commands"),
    ("`ray up` (SSH, the way to more machines)", "ray-up-ssh-the-way-to-more-machines"),
    ("Budgets `auto`", "budgets-auto"),
    ("CPU decode against llama.cpp", "cpu-decode-against-llamacpp"),
    ("gpt-oss and DeepSeek-V3", "gpt-oss-and-deepseek-v3"),
    ("Serving engine: batching, paged KV cache, speculative decoding",
     "serving-engine-batching-paged-kv-cache-speculative-decoding"),
    ("One workstation, one command", "one-workstation-one-command"),
    ("Sockets, token, temp dir", "sockets-token-temp-dir"),
    ("The `step_mux.py` of [services](services/)", "the-step_muxpy-of-services"),
    ("**Bold** words", "bold-words"),
    ("Ünïcode — dash", "ünïcode--dash"),
])
def test_github_anchor(heading, anchor):
    assert github_anchor(heading) == anchor


def test_repeated_headings_are_numbered_and_code_blocks_ignored():
    text = "# A\n\n## Notes\n\n```bash\n# not a heading\n```\n\n## Notes\n\n### Notes\n"
    assert anchors_of(text) == {"a", "notes", "notes-1", "notes-2"}


def _tree(tmp_path: Path, readme: str, pages: dict[str, str]) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme)
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_checker_reports_missing_files_and_anchors(tmp_path):
    root = _tree(tmp_path, "# R\n\n[a](docs/a.md#kept) [b](docs/b.md) [c](docs/a.md#gone) [d](#r)"
                           " [e](#nope) [f](../outside.md) `[g](docs/in-code.md)`\n",
                 {"docs/a.md": "# A\n\n## Kept\n\n[back](../README.md#r) [dir](../docs/)\n"})
    problems = check_tree(root)
    assert len(problems) == 4, problems
    assert any("docs/b.md: no such file" in p for p in problems)
    assert any("docs/a.md#gone: no heading" in p for p in problems)
    assert any("#nope: no heading" in p for p in problems)
    assert any("../outside.md leaves the repository" in p for p in problems)


def test_checker_accepts_a_page_written_elsewhere_only_while_absent(tmp_path):
    root = _tree(tmp_path, "# R\n\n[x](docs/x.md)\n", {})
    assert check_tree(root) == ["README.md:3: docs/x.md: no such file or directory"]
    assert check_tree(root, frozenset({"docs/x.md"})) == []
    (root / "docs/x.md").write_text("# X\n\n[broken](y.md)\n")
    assert check_tree(root, frozenset({"docs/x.md"})) == ["docs/x.md:3: y.md: no such file or directory"]


def test_missing_code_paths_are_reported(tmp_path):
    root = _tree(tmp_path, "# R\n\n`engine/a.py` `engine/gone.py` `tests/t.py::test_x` `engine/models/<arch>/`"
                           " `engine/{a,b}.py` `not/a/repo/path.py`\n\n```\n`engine/in_fence.py`\n```\n", {})
    (root / "engine").mkdir()
    (root / "engine/a.py").write_text("")
    assert missing_code_paths(root) == ["README.md:3: `engine/gone.py` does not exist",
                                        "README.md:3: `tests/t.py` does not exist"]


def test_unreachable_pages_are_found_through_chains(tmp_path):
    root = _tree(tmp_path, "# R\n\n[a](docs/a.md)\n",
                 {"docs/a.md": "# A\n\n[b](b.md#b)\n", "docs/b.md": "# B\n", "docs/c.md": "# C\n"})
    assert unreachable_pages(root) == ["docs/c.md"]


def test_documented_options_are_read_per_section():
    text = ("## Options by command\n\n### `moestream a [X]`\n\n| option | default |\n|---|---|\n"
            "| `--x/--no-x` | off |\n| `--y`, `--z` | 1, 2 |\n\n### `moestream b`, `c`\n\nNo options.\n\n"
            "## Elsewhere\n\n| `--not-an-option` | |\n")
    assert documented_options(text) == {("a",): {"--x", "--no-x", "--y", "--z"}, ("b", "c"): set()}


def test_two_commands_must_be_whole_lines_of_a_bash_block():
    text = "```bash\nbash deploy/setup.sh && .venv/bin/moestream demo --x\n```\n"
    assert TWO_COMMANDS[0] not in _bash_block_lines(text)
    text = "```\n.venv/bin/python -m pytest -q\n```\n"
    assert TWO_COMMANDS[1] not in _bash_block_lines(text)

"""What the documentation pages hold, read from their Markdown: fenced code blocks (the commands, in ```sh blocks,
and sample outputs, in ```text blocks), the markers that tie an output to the command above it or a part of a page
to a generator, and flag tables.

    ```sh                                   a command block: every command in it is checked (tests/docs/commands.py)
    python tools/plan_memory.py ...
    ```
    <!-- output of the command above -->   the next ```text block is that command's output (lines A-B: a slice)
    <!-- generated: NAME -->                what lies between this and `<!-- end generated -->` is GENERATORS[NAME]
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from tests.cli import ROOT

LANGUAGES = ("sh", "text", "yaml", "python")  # every fenced block says which it is
OUTPUT = re.compile(r"<!-- output of the command above(?:, lines (\d+)-(\d+))? -->")
GENERATED = re.compile(r"<!-- generated: ([\w-]+) -->")
END_GENERATED = "<!-- end generated -->"
INLINE_FLAG = re.compile(r"`(--[a-z0-9][a-z0-9-]*)[ =`]")  # a backticked span that starts with a flag's name


def pages() -> list[str]:
    """Every documentation page, relative to the repository: the README, docs/*.md and bench/README.md."""
    found = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT)) + ["bench/README.md"]
    return [page for page in found if os.path.isfile(os.path.join(ROOT, page))]


def read(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read().split("\n")


@dataclass(frozen=True)
class Block:
    """A fenced code block: lines[first:last] are its content (the fences are lines first - 1 and last)."""

    page: str
    language: str
    first: int
    last: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.first}"


def blocks(page: str, lines: list[str]) -> list[Block]:
    """The page's fenced blocks in order; a fence without a language or an unclosed one is an AssertionError."""
    found, index = [], 0
    while index < len(lines):
        fence = lines[index].strip()
        if fence.startswith("```"):
            language = fence[3:].strip()
            assert language in LANGUAGES, f"{page}:{index + 1}: a fenced block says which it is: {LANGUAGES}"
            end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), None)
            assert end is not None, f"{page}:{index + 1}: the block is never closed"
            found.append(Block(page, language, index + 1, end, "\n".join(l.rstrip() for l in lines[index + 1:end])))
            index = end
        index += 1
    return found


def output_blocks(page: str, lines: list[str]) -> list[tuple[Block, Block, tuple[int, int] | None]]:
    """[(the command block above, the output block, its (first, last) line slice or None)] for each output marker."""
    found, all_blocks = [], blocks(page, lines)
    for index, line in enumerate(lines):
        match = OUTPUT.fullmatch(line.strip())
        if not match:
            continue
        after = [b for b in all_blocks if b.first > index + 1]
        before = [b for b in all_blocks if b.last < index and b.language == "sh"]
        assert after and after[0].first == index + 2 and after[0].language == "text", \
            f"{page}:{index + 1}: an output marker comes right before its ```text block"
        assert before, f"{page}:{index + 1}: an output marker needs a ```sh block above it"
        lines_slice = (int(match.group(1)), int(match.group(2))) if match.group(1) else None
        found.append((before[-1], after[0], lines_slice))
    return found


def generated_parts(page: str, lines: list[str]) -> list[tuple[str, int, int]]:
    """[(generator name, first line index inside, end marker's index)] of the page's generated parts."""
    found = []
    for index, line in enumerate(lines):
        match = GENERATED.fullmatch(line.strip())
        if match:
            end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == END_GENERATED), None)
            assert end is not None, f"{page}:{index + 1}: {END_GENERATED} is missing"
            found.append((match.group(1), index + 1, end))
    return found


def inline_flags(lines: list[str]) -> list[tuple[int, str]]:
    """[(line number, flag)] for each backticked span outside code blocks that starts with a flag's name."""
    found, inside = [], False
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            found += [(number, flag) for flag in INLINE_FLAG.findall(line)]
    return found


def table_rows(lines: list[str], header: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """[(line index, cells)] of the rows of every table whose header row is `header` (lower-cased cells)."""
    rows, inside = [], False
    for index, line in enumerate(lines):
        if not line.startswith("|"):
            inside = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if tuple(c.lower() for c in cells) == header:
            inside = True
        elif inside and not set(line) <= set("|-: "):
            rows.append((index, cells))
    return rows

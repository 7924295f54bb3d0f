"""Documentation that cannot go stale (tests/docs/): every command a page shows names a program that exists and
flags its parser has (each program run with --help), every backticked flag in the prose exists, every flag of
pretrain_gpt.py has a row in docs/training-flags.md, every link leads to a file, and every part the code determines
(sample outputs, flag defaults, the Megatron-LM table) is what `make docs` makes now."""

import glob
import os
import re

import pytest

from mpzero.cli.megatron_flags import NOT_IN_MPZERO
from tests.cli import ROOT
from tests.docs import commands
from tests.docs.markdown import blocks, inline_flags, pages, read, table_rows
from tests.docs.update import FLAG_TABLE, flag_actions, update

PAGES = pages()
TOOLS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tools", "*.py")))


def _commands(page):
    for block in blocks(page, read(page)):
        if block.language == "sh":
            for line in commands.shell_lines(block.text):
                yield block, line


def test_the_pages_are_found():
    assert {"README.md", "docs/training-flags.md", "docs/megatron.md", "bench/README.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_command_names_a_program_and_flags_that_exist(page):
    wrong = []
    for block, line in _commands(page):
        try:
            command = commands.parse(line)
            wrong += [f"{block.where}: {p}" for p in (commands.problems(command) if command else [])]
        except AssertionError as error:
            wrong.append(f"{block.where}: {error}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_runs_help(tool):
    assert "--help" in commands.options(tool)


def _known_flags():
    known = set(flag_actions()) | set(NOT_IN_MPZERO) | set(commands._torchrun_options())
    for tool in TOOLS:
        known |= commands.options(tool)
    for page in PAGES:
        for _, line in _commands(page):
            command = commands.parse(line)
            ours = command and (command.program.endswith(".py") or command.program.startswith("-m "))
            if ours and command.program not in commands.NO_HELP:
                known |= commands.options(command.program, command.subcommand)
    return known


def test_every_flag_named_in_the_prose_exists():
    known = _known_flags()
    unknown = [f"{page}:{number}: {flag}" for page in PAGES for number, flag in inline_flags(read(page))
               if flag not in known]
    assert not unknown, "\n".join(unknown)


def test_every_flag_of_pretrain_gpt_has_a_row_in_the_flag_tables():
    rows = table_rows(read("docs/training-flags.md"), FLAG_TABLE)
    listed = {flag for _, cells in rows for flag in re.findall(r"`(--[a-z0-9-]+)`", cells[0])}
    missing = sorted(set(flag_actions()) - listed)
    assert not missing, f"docs/training-flags.md has no row for {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES)
def test_every_link_leads_to_a_file(page):
    folder = os.path.dirname(os.path.join(ROOT, page))
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", "\n".join(read(page)))
    broken = [link for link in links if "://" not in link and not os.path.exists(os.path.join(folder, link))]
    assert not broken, f"{page}: {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_the_parts_the_code_determines_are_current(page):
    stale = update(page, write=False)
    assert not stale, "run `make docs` (python -m tests.docs.update) and read the diff:\n" + "\n".join(stale)

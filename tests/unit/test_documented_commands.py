"""Every command the Markdown documents show is one the code accepts, checked without running it.

A reader copies `instcls ...` and `make ...` from the repository's Markdown (README.md, docs/*.md,
k8s/README.md and any other); a flag renamed in the CLI, or a Makefile target removed, must fail here
rather than in the reader's shell.  The commands come from shell code blocks (plain, bash, sh,
console fences; `$ ` prompts, `\\` continuations, `&&` / `;` / `|` chains, `VAR=value` prefixes,
commented-out `instcls` steps and the code spans of a comment; a comment starting "make sure" is
English, so commented-out `make` lines are not read) and from the code spans of the prose
(`instcls plan --ranks 8`), wherever they break a line.

What is checked, against the real parsers (nothing is declared twice):

- `instcls` (also `.venv/bin/instcls` and `python -m trainer.cli`): each sub-command named exists in
  `trainer.cli.build_parser()`, and each flag (a token starting with `-`, `--flag=value` cut at `=`) is
  an option string of the parser it reaches, spelled out: argparse would also take an unambiguous
  prefix, which a later option can make ambiguous.  Positional values and placeholders (`FILE`,
  `<N>`, `...`) are not checked.  A command that stops at a parent (`instcls bench --ranks 2`)
  stands for its sub-commands: each flag must belong to one of them.
- `instcls launch` is torchrun, as `trainer.cli.main` runs it: the options before `-m MODULE` or the
  script (`trainer.parallel.torchrun_arguments.options_end`) must be options of torchrun's own parser
  (`torch.distributed.run.get_args_parser`), and what follows `-m trainer.cli` is checked as an
  `instcls` command; so is what follows `-m trainer.cli` after `torchrun` or `deepspeed` (torchrun's
  options as above; DeepSpeed's launcher options are not this project's and are not checked).
- `make`: each target (not `VAR=value`, not an option) is the target of a rule in the Makefile; a name
  left in `.PHONY` after its rule was deleted is no target.  A `make -C DIR` / `-f FILE` is another
  Makefile's and is skipped.

CHANGELOG.md is not read: its history names flags as they were when each entry was written.
k8s/schemas/ holds vendored CRD schemas; its README, ours, is read like the others.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_DOCUMENTS = {"CHANGELOG.md"}
# Not the project's Markdown: environments, build and run outputs (an export's model card is README.md).
SKIPPED_FOLDERS = {"out", "build", "dist", "node_modules", "__pycache__"}

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# words before a command in the same simple command: `for ...; do instcls ...`, `time make demo`
PREFIXES = {"do", "then", "else", "if", "while", "until", "time", "!", "exec", "env"}
SEPARATORS = {";", ";;", "&", "&&", "|", "||", "|&"}
PLACEHOLDER = re.compile(r"^(<[^>]*>|\.\.\.|…|[A-Z][A-Z0-9_]*)$")
# the words that start a command this test checks: anything else (kubectl, docker, scripts/...) is not
COMMAND_WORD = re.compile(r"^(?:\S*/)?(instcls|make|torchrun|deepspeed|python[0-9.]*)$")


@dataclass(frozen=True)
class Command:
    """One command as a document shows it: where, the text, and its words from the command word on."""

    where: str
    text: str
    words: tuple[str, ...]


def documents() -> list[Path]:
    """The repository's own Markdown files, CHANGELOG.md aside."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith(".")
                               and name not in SKIPPED_FOLDERS and not name.endswith(".egg-info"))
        found += [Path(folder) / name for name in sorted(files)
                  if name.endswith(".md") and name not in NOT_DOCUMENTS]
    return found


# --- extraction -------------------------------------------------------------------------------------

def split_comment(line: str) -> tuple[str, str, bool]:
    """A shell line's code, its comment (from a `#` that starts a word outside quotes), and whether a
    quote is left open at its end (the string goes on on the next line)."""
    quote, escaped = None, False
    for index, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index], line[index + 1:], False
    return line, "", quote is not None


def shell_words(text: str) -> list[list[str]]:
    """The simple commands of a shell line (split at `;`, `&&`, `|`, ...), each as shlex's words."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands, words = [], []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [words for words in commands + [words] if words]


def commands_of_text(text: str, where: str) -> list[Command]:
    """The checked commands a piece of shell text holds, from their command word on (`VAR=value`
    prefixes dropped); a text shlex cannot split is returned whole, for the check to report."""
    text = " ".join(text.split())
    try:
        simple_commands = shell_words(text)
    except ValueError:
        first = text.split()
        if any(COMMAND_WORD.match(word) for word in first[:1]):
            return [Command(where, text, ())]
        return []
    found = []
    for words in simple_commands:
        while words and (ASSIGNMENT.match(words[0]) or words[0] in PREFIXES):
            words = words[1:]
        if not words or not COMMAND_WORD.match(words[0]):
            continue
        if re.match(r"^(?:\S*/)?python[0-9.]*$", words[0]) and words[1:3] != ["-m", "trainer.cli"]:
            continue  # python for something else (a script, another module)
        found.append(Command(where, text, tuple(words)))
    return found


def commands_of_spans(text: str, name: str, first_line: int) -> list[Command]:
    """The commands in the code spans of a piece of prose (a span may break a line)."""
    found = []
    for match in CODE_SPAN.finditer(text):
        line = first_line + text.count("\n", 0, match.start())
        found += commands_of_text(match.group(2), f"{name}:{line}")
    return found


def shell_block_commands(lines: list[tuple[int, str]], name: str) -> list[Command]:
    """The commands of a shell code block: its code, the commands a comment holds as its first words
    (commented-out steps, `\\` continued over comment lines) and the code spans of its comments."""
    found = []
    index = 0
    while index < len(lines):
        number, line = lines[index]
        line = re.sub(r"^\s*\$\s+", "", line)  # a prompt
        commented = line.lstrip().startswith("#")
        while index + 1 < len(lines):
            if line.rstrip().endswith("\\"):
                following = lines[index + 1][1]
                if commented:
                    following = re.sub(r"^\s*#", "", following)
                line = line.rstrip()[:-1] + " " + following.strip()
            elif split_comment(line)[2]:  # a quoted string over several lines
                line += "\n" + lines[index + 1][1]
            else:
                break
            index += 1
        index += 1
        code, comment, _ = split_comment(line)
        where = f"{name}:{number}"
        found += commands_of_text(code, where)
        found += commands_of_spans(comment, name, number)
        if commented and not CODE_SPAN.search(comment):  # a step left out: `#   instcls make-shards ...`
            found += [command for command in commands_of_text(comment, where)
                      if os.path.basename(command.words[0]) != "make"]
    return found


def documented_commands(markdown: str, name: str) -> list[Command]:
    """Every `instcls`, `python -m trainer.cli`, torchrun, deepspeed and `make` command of a Markdown
    text: in its shell code blocks, and in the code spans of its prose."""
    found: list[Command] = []
    block: list[tuple[int, str]] | None = None
    fence, language = "", ""
    paragraph: list[tuple[int, str]] = []

    def end_paragraph() -> None:
        if paragraph:
            found.extend(commands_of_spans("\n".join(line for _, line in paragraph), name, paragraph[0][0]))
            paragraph.clear()

    for number, line in enumerate(markdown.splitlines(), 1):
        opening = FENCE.match(line)
        if block is None and opening:
            end_paragraph()
            block, fence, language = [], opening.group(1), opening.group(2).lower()
        elif block is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                if language in SHELL_FENCES:
                    found += shell_block_commands(block, name)
                block = None
            else:
                block.append((number, line))
        elif line.strip():
            paragraph.append((number, line))
        else:
            end_paragraph()
    end_paragraph()
    return found


# --- what the code accepts --------------------------------------------------------------------------

@dataclass(frozen=True)
class Accepted:
    """What the code accepts: the instcls parser, torchrun's option strings, the Makefile's targets."""

    parser: argparse.ArgumentParser
    torchrun_options: frozenset[str]
    make_targets: frozenset[str]


@lru_cache(maxsize=1)
def accepted() -> Accepted:
    from torch.distributed.run import get_args_parser

    from trainer.cli import build_parser

    return Accepted(build_parser(), frozenset(options(get_args_parser())),
                    frozenset(make_targets((ROOT / "Makefile").read_text())))


def make_targets(makefile: str) -> set[str]:
    """The targets of a Makefile's rules (names only: no pattern or variable targets)."""
    targets = set()
    for line in makefile.replace("\\\n", " ").splitlines():
        rule = re.match(r"^([^\s#:=][^:=]*?)\s*::?(?!=)", line)
        if rule and not line.startswith(("\t", " ")):
            targets.update(name for name in rule.group(1).split() if not re.search(r"[$%]", name))
    return targets - {".PHONY"}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(action.choices) for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


def family_options(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of a parser and of every command below it."""
    return options(parser).union(*(family_options(child) for child in subcommands(parser).values()))


def is_flag(word: str) -> bool:
    return len(word) > 1 and word.startswith("-") and not re.match(r"^-[\d.]", word)


def flag_name(word: str) -> str:
    return word.strip("[]()").partition("=")[0]


def instcls_problems(words: list[str], known: Accepted, path: str = "instcls") -> list[str]:
    """What `instcls WORDS` names that the parser does not have: a sub-command, or a flag."""
    if words[:1] == ["launch"]:  # trainer.cli.main hands everything after it to torchrun
        return torchrun_problems(words[1:], known, f"{path} launch")
    problems = []
    parsers = [known.parser]  # the commands reached so far (several for `bench a|b`)
    family = False  # `parsers` stand for their sub-commands, any of them: the words left are values
    skip_value = False
    for word in words:
        word = word.strip("[]")
        if skip_value or not word:
            skip_value = False
            continue
        if word == "--":
            break
        if is_flag(word):
            name = flag_name(word)
            if not family and all(name in options(parser) for parser in parsers):
                # a parent's own option before its sub-command: its value is no sub-command
                skip_value = "=" not in word and any(
                    subcommands(parser) and action.nargs != 0
                    for parser in parsers for action in parser._actions if name in action.option_strings)
            elif not family and all(subcommands(parser) and name in family_options(parser) for parser in parsers):
                family = True  # `instcls bench --ranks 2`: a sub-command's flag, the sub-command left out
            elif not (family and any(name in family_options(parser) for parser in parsers)):
                problems.append(f"`{path}` has no flag {name}")
            continue
        choices = [subcommands(parser) for parser in parsers]
        if family or not all(choices):
            continue  # a value
        if PLACEHOLDER.match(word):
            parsers, family = [child for named in choices for child in named.values()], True
            path += f" {word}"
            continue
        reached = []
        for name in word.split("|"):
            if all(name in named for named in choices):
                reached += [named[name] for named in choices]
            else:
                problems.append(f"`{path}` has no sub-command {name!r}")
        if not reached:
            return problems
        parsers, path = reached, f"{path} {word}"
    return problems


def torchrun_problems(words: list[str], known: Accepted, path: str) -> list[str]:
    """torchrun's options checked against its parser; then `-m trainer.cli ...` as an instcls command."""
    from trainer.parallel.torchrun_arguments import options_end

    end = options_end(words)
    problems = [f"`{path}` (torchrun) has no flag {flag_name(word)}"
                for word in words[:end] if is_flag(word) and flag_name(word) not in known.torchrun_options]
    return problems + program_problems(words[end:], known)


def program_problems(words: list[str], known: Accepted) -> list[str]:
    """The program a launcher runs: checked when it is `-m trainer.cli`."""
    if words[:2] in (["-m", "trainer.cli"], ["--module", "trainer.cli"]):
        return instcls_problems(words[2:], known)
    return []


def make_problems(words: list[str], known: Accepted) -> list[str]:
    """make's targets: each word that is neither an option (nor its value) nor a `VAR=value`."""
    if any(flag_name(word) in ("-C", "-f", "--directory", "--file", "--makefile") for word in words):
        return []  # another Makefile
    problems, skip_value = [], False
    for word in words:
        if skip_value:
            skip_value = False
        elif is_flag(word):
            skip_value = word in ("-I", "-o", "-W")
        elif not (word.isdigit() or ASSIGNMENT.match(word) or word in known.make_targets):  # a digit: -j N
            problems.append(f"the Makefile has no target {word!r}")
    return problems


def command_problems(command: Command, known: Accepted) -> list[str]:
    """What a documented command names that the code does not accept ([] when it is all there)."""
    if not command.words:
        return ["the command cannot be split into shell words"]
    word, rest = os.path.basename(command.words[0]), list(command.words[1:])
    if word == "instcls":
        return instcls_problems(rest, known)
    if word == "make":
        return make_problems(rest, known)
    if word == "torchrun":
        return torchrun_problems(rest, known, "torchrun")
    if word == "deepspeed":
        module = next((index for index, arg in enumerate(rest) if arg in ("-m", "--module")), len(rest))
        return program_problems(rest[module:], known)
    return program_problems(rest, known)  # python -m trainer.cli


def drift(markdown: str, name: str, known: Accepted) -> list[str]:
    """Every problem of a Markdown text's commands, one line each: where, the command, what is wrong."""
    return [f"{command.where}: {' '.join(command.words) or command.text}: {problem}"
            for command in documented_commands(markdown, name) for problem in command_problems(command, known)]


# --- the tests --------------------------------------------------------------------------------------

def test_every_documented_command_names_what_the_code_has():
    """The repository's documents against the CLI, torchrun and the Makefile; every drift is listed."""
    known = accepted()
    problems, commands = [], 0
    for document in documents():
        name = str(document.relative_to(ROOT))
        text = document.read_text()
        commands += len(documented_commands(text, name))
        problems += drift(text, name, known)
    assert commands > 100, f"only {commands} commands found: the extraction lost them"
    assert not problems, "documented commands the code does not accept:\n" + "\n".join(problems)


def test_the_documents_read_are_ours():
    """The walk finds the documents and leaves out the changelog, environments and run outputs."""
    names = {str(path.relative_to(ROOT)) for path in documents()}
    assert {"README.md", "k8s/README.md", "docs/training.md"} <= names
    assert "CHANGELOG.md" not in names and not any(name.startswith(("out/", ".venv/")) for name in names)


SYNTHETIC = """\
# Title

Plan first with `instcls plan --rankz 8`, then `make demoo`.

```bash
$ instcls plan --num-classes 1000 --ranks 8 --batch=256 \\
    --gpu-memory-gib 80   # fits
OMP_NUM_THREADS=1 .venv/bin/instcls bench classifier --ranks 2 && make test-unit TEST_WORKERS=1
instcls launch --nproc-per-node 2 --max-restarts=1 -m trainer.cli train --config FILE --resum auto
instcls launch --nprocs-per-node 2 -m trainer.cli train --config FILE
instcls bench <name> --ranks 2
instcls bench sclae
instcls plan --rank 8
# instcls eval knn --checkpoint auto --nope \\
#     --config FILE
torchrun --nproc-per-node 2 -m trainer.cli train --config FILE --set max_steps=2
# make sure the shards are there first
```

```python
subprocess.run(["instcls", "plan", "--whatever"])
```

A span over a line break: `instcls export --config FILE --checkpoint auto
--out DIR [--with-head] [--force]`; and `instcls eval --checkpoint random-init`.
"""


def test_a_renamed_flag_and_an_unknown_target_are_reported_where_they_are():
    """Each wrong flag, sub-command, torchrun option and target is named with its line and command; the
    right ones around them (placeholders, prefixes, `=` values, a python block) are not."""
    problems = drift(SYNTHETIC, "doc.md", accepted())
    assert problems == [
        "doc.md:3: instcls plan --rankz 8: `instcls plan` has no flag --rankz",
        "doc.md:3: make demoo: the Makefile has no target 'demoo'",
        "doc.md:9: instcls launch --nproc-per-node 2 --max-restarts=1 -m trainer.cli train --config FILE --resum auto: "
        "`instcls train` has no flag --resum",
        "doc.md:10: instcls launch --nprocs-per-node 2 -m trainer.cli train --config FILE: "
        "`instcls launch` (torchrun) has no flag --nprocs-per-node",
        "doc.md:12: instcls bench sclae: `instcls bench` has no sub-command 'sclae'",
        # a prefix argparse would take: refused, a later option (--ranks-per-node) could make it ambiguous
        "doc.md:13: instcls plan --rank 8: `instcls plan` has no flag --rank",
        "doc.md:14: instcls eval knn --checkpoint auto --nope --config FILE: `instcls eval` has no flag --nope",
    ]


def test_correct_commands_pass_in_every_form():
    """The same spans corrected, and a chain with a pipe: found word for word, and nothing reported."""
    text = SYNTHETIC.split("```bash")[0].replace("--rankz", "--ranks").replace("demoo", "demo")
    text += ("\n```sh\ninstcls plan --config my.yaml --ranks 8 | tee plan.txt; make lint\n"
             "python -m trainer.cli selftest\n```\n")
    commands = documented_commands(text, "doc.md")
    assert [command.words for command in commands] == [
        ("instcls", "plan", "--ranks", "8"), ("make", "demo"),
        ("instcls", "plan", "--config", "my.yaml", "--ranks", "8"), ("make", "lint"),
        ("python", "-m", "trainer.cli", "selftest")]
    assert drift(text, "doc.md", accepted()) == []


def test_what_the_extraction_finds_in_a_block():
    """Every command of the synthetic text at its line: none lost, none found twice, none from python."""
    commands = documented_commands(SYNTHETIC, "doc.md")
    wheres = [command.where for command in commands]
    # the continued first line counts once, at its first line; the python block holds none
    assert wheres == ["doc.md:3", "doc.md:3", "doc.md:6", "doc.md:8", "doc.md:8", "doc.md:9", "doc.md:10",
                      "doc.md:11", "doc.md:12", "doc.md:13", "doc.md:14", "doc.md:16", "doc.md:24", "doc.md:25"]
    assert commands[2].words[-2:] == ("--gpu-memory-gib", "80")
    assert commands[3].words[0] == ".venv/bin/instcls" and commands[4].words == ("make", "test-unit", "TEST_WORKERS=1")


def test_the_real_documents_fail_when_a_documented_flag_is_renamed():
    """The check of README.md against a parser whose `plan --gpu-memory-gib` became `--device-memory-gib`."""
    from trainer.cli import build_parser

    parser = build_parser()
    plan = subcommands(parser)["plan"]
    action = next(action for action in plan._actions if "--gpu-memory-gib" in action.option_strings)
    action.option_strings = ["--device-memory-gib"]
    renamed = Accepted(parser, accepted().torchrun_options, accepted().make_targets)
    readme = (ROOT / "README.md").read_text()
    assert drift(readme, "README.md", accepted()) == []
    uses = [command for command in documented_commands(readme, "README.md") if "--gpu-memory-gib" in command.words]
    assert uses, "README.md no longer shows --gpu-memory-gib: pick another documented flag"
    assert drift(readme, "README.md", renamed) == [
        f"{command.where}: {' '.join(command.words)}: `instcls plan` has no flag --gpu-memory-gib" for command in uses]


@pytest.mark.parametrize("makefile, targets", [
    ("A := x\nB ?= y\n.PHONY: gone demo\ndemo: $(A) \\\n  more\n\tcmd: not a rule\nx y: z\n$(A)/%.o: q\n",
     {"demo", "x", "y"}),
])
def test_makefile_targets_are_its_rules(makefile, targets):
    """Rule lines name targets; assignments, recipes, patterns and a .PHONY name without a rule do not."""
    assert make_targets(makefile) == targets

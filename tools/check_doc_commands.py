#!/usr/bin/env python3
"""Fails when a command in the docs runs a shipped binary with a flag it does
not take, or shardctl with a command it does not have.

Reads the Markdown files given (README.md, docs/*.md, deploy/README.md), finds
every command that runs one of the binaries named by --binary (in fenced and
indented code, lines joined at a trailing backslash, and in inline `code` of
the prose), and checks each --flag it passes against that binary's own
--helpfull, and each shardctl command against `shardctl --help`.

usage:
  tools/check_doc_commands.py --binary shard_server=PATH [--binary ...] FILE.md ...
      (//tests/docs:doc_commands_test runs this)
"""
import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys

# Fences whose lines are shell: untagged ones hold commands and their output
# alike, and output rarely names a binary with flags.
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", ";;"}
REDIRECTION = re.compile(r"^\d*(>|>>|<|>&|<&|&>)\d*$")
# Abseil's usage flags, which --helpfull does not list.
USAGE_FLAGS = {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version",
               "only_check_args"}


def flags_of(path):
    """Every flag the binary's --helpfull lists (every library's section)."""
    out = subprocess.run([path, "--helpfull"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s{4}--(\w+) \(", out, re.M)) | USAGE_FLAGS


def commands_of(path):
    """shardctl's commands: the first word of each line under "Commands:"."""
    out = subprocess.run([path, "--help"], capture_output=True, text=True).stdout
    section = out.split("Commands:", 1)[1] if "Commands:" in out else ""
    names = set()
    for line in section.splitlines()[1:]:
        if not line.strip():
            break
        words = line.split()
        names.add(" ".join(words[:2]) if words[0] == "job" else words[0])
    return names


def code_and_prose(text):
    """Yields (line number, text) of shell code lines (continuations joined)
    and of inline `code` spans of the prose (spans may wrap lines)."""
    code, prose = [], []
    fence = None
    indented = False
    previous_blank = True
    for number, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^\s*```(\w*)", line)
        if m:
            fence = m.group(1) if fence is None else None
            prose.append((number, ""))
            continue
        if fence is not None:
            if fence in SHELL_FENCES:
                code.append((number, line))
            prose.append((number, ""))
            continue
        list_item = re.match(r"^\s*([-*]|\d+\.)\s", line)
        if line.startswith("    ") and (previous_blank or indented) and not list_item:
            indented = True
            code.append((number, line))
            prose.append((number, ""))
            previous_blank = False
            continue
        blank = not line.strip()
        if not (indented and blank):
            indented = False
        previous_blank = blank
        prose.append((number, "" if indented else line))
    i = 0
    while i < len(code):
        number, joined = code[i]
        while (joined.rstrip().endswith("\\") and i + 1 < len(code) and
               code[i + 1][0] == code[i][0] + 1):
            i += 1
            joined = joined.rstrip()[:-1] + " " + code[i][1].strip()
        yield number, joined
        i += 1
    text_of_prose = ""
    starts = []
    for number, line in prose:
        starts.append((len(text_of_prose), number))
        text_of_prose += line + "\n"
    for m in re.finditer(r"(`+)(.+?)\1", text_of_prose, re.S):
        number = max(n for offset, n in starts if offset <= m.start())
        yield number, m.group(2).replace("\n", " ")


def tokens(text):
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        return list(lexer)
    except ValueError:  # an unbalanced quote in prose
        return text.split(" #")[0].split()


def binary_named(token, binaries):
    token = token.strip("\"'[]")
    if token.startswith("//"):
        return None  # a Bazel label
    base = token.rsplit("/", 1)[-1]
    return base if base in binaries else None


def check_line(text, binaries, flags, shardctl_commands):
    """What is wrong with the commands on this line, as messages."""
    words = tokens(text)
    problems = []
    i = 0
    while i < len(words):
        binary = binary_named(words[i], binaries)
        if binary is None:
            i += 1
            continue
        command = None
        j = i + 1
        while j < len(words):
            word = words[j]
            if word in SEPARATORS or binary_named(word, binaries):
                break
            if REDIRECTION.match(word):
                j += 2
                continue
            word = word.strip("[]")
            m = re.match(r"--(\w+)", word)
            if m:
                name = m.group(1)
                known = flags[binary]
                if name not in known and not (name.startswith("no") and name[2:] in known):
                    close = difflib.get_close_matches(name, known, n=1)
                    hint = f" (did you mean --{close[0]}?)" if close else ""
                    problems.append(f"{binary} takes no --{name}{hint}")
            elif binary == "shardctl" and command is None and re.match(r"^[a-z]+$", word):
                command = word
                if word == "job" and j + 1 < len(words):
                    command = "job " + words[j + 1]
                    j += 1
                if command not in shardctl_commands:
                    problems.append(f"shardctl has no command '{command}'")
            j += 1
        i = j
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", action="append", default=[], required=True,
                        help="NAME=PATH of a shipped binary")
    parser.add_argument("files", nargs="+", help="Markdown files")
    args = parser.parse_args()
    paths = dict(b.split("=", 1) for b in args.binary)
    for name, path in paths.items():
        if not os.access(path, os.X_OK):
            print(f"check_doc_commands: {name} is not an executable at {path}", file=sys.stderr)
            return 2
    flags = {name: flags_of(path) for name, path in paths.items()}
    shardctl_commands = commands_of(paths["shardctl"]) if "shardctl" in paths else set()
    checked = 0
    failures = []
    for md in args.files:
        with open(md) as f:
            text = f.read()
        for number, line in code_and_prose(text):
            if not any(binary_named(w, paths) for w in tokens(line)):
                continue
            checked += 1
            for problem in check_line(line, paths, flags, shardctl_commands):
                failures.append(f"{md}:{number}: {problem}\n    {line.strip()[:160]}")
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"check_doc_commands: {checked} command lines in {len(args.files)} files, "
          f"{len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The commands README.md and docs/*.md print, extracted from their fenced shell blocks and classified.

A block's lines are joined across trailing backslashes, `cmd1 && cmd2` is two commands, `#` starts a
comment. A comment line right after a command that starts with `# config error`, `# error` or
`# exit N` says the command is expected to fail (with that text on stderr, or that exit code).
Every command gets one kind:
- setup: `pip install ...` (the environment the tests run in already has it);
- suite: `python -m pytest ...` (this test suite itself);
- local: runs on this machine: `python ...` (the trainer's modules, scripts, benchmarks);
- cluster: needs a cloud or cluster (`gcloud`, `docker push`, `xpk`, `kubectl`, `sbatch`, ...): not run here;
  what they deploy is rendered by `python -m scripts.deploy.render`, which runs as a local command;
- shell: `export`, `cd`, `mkdir`: run as part of the block;
- external: needs software this project does not install, or a job still training (its own comment
  starts with `# needs:`, e.g. the MaxText comparison, a request to a running job): not run here.
A training command documented to resume a finished run (and so train nothing) says so in its own comment,
`# resumes ...`; every other one must train at least one step.
A command whose own comment starts with `# cluster:` (e.g. the TPU-sized headline command) is a cluster
command too.
An unknown program fails the classification test, so a new kind of documented command needs a decision.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
CLUSTER_PROGRAMS = {"gcloud", "xpk", "kubectl", "sbatch", "srun", "scontrol", "gsutil"}
SHELL_BUILTINS = {"export", "cd", "mkdir"}
FAIL_COMMENT = re.compile(r"#\s*(config error|error|exit (\d+))\b(.*)")


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str  # README.md, docs/x.md
    line: int  # 1-based line of the command in the doc
    text: str  # the command as printed (continuations joined)
    kind: str  # setup | suite | local | cluster | shell | external
    expect_fail: str = ""  # text expected on stderr (or "exit N") when documented to fail
    resumes: bool = False  # documented (`# resumes`) to resume a finished run: it may train no step

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def program(self) -> list[str]:
        """`argv` without the leading `VAR=value` assignments."""
        return without_assignments(self.argv)

    @property
    def trains(self) -> bool:
        """A training command: run again, it resumes its run."""
        return self.program[:3] == ["python", "-m", "trainer.train"]


def without_assignments(argv: list[str]) -> list[str]:
    """A command line's words from its program on (`XLA_FLAGS=... python ...` -> `python ...`)."""
    i = 0
    while i < len(argv) and "=" in argv[i] and argv[i].split("=")[0].isupper():
        i += 1
    return argv[i:]


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block in a shell language."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start, body = m.group(1), i + 2, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in SHELL_FENCES:
            out.append((start, body))
    return out


def kind_of(text: str) -> str:
    words = shlex.split(text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value cmd
        words = words[1:]
    program = words[0]
    if program.startswith("./") and program.endswith(".sh"):  # a rendered submit script: runs against a cluster
        return "cluster"
    if program in SHELL_BUILTINS:
        return "shell"
    if program in CLUSTER_PROGRAMS or (program == "docker" and words[1:2] in (["push"], ["login"])):
        return "cluster"
    if program == "docker":
        return "docker"
    if program == "pip" or words[:4] == ["python", "-m", "pip", "install"]:
        return "setup"
    if program == "python" and words[1:3] == ["-m", "pytest"]:
        return "suite"
    if program == "python":
        return "local"
    raise ValueError(f"unclassified documented command {text!r}: teach tests/doc_commands.py its kind")


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a '#' inside quotes or a word is kept)."""
    in_single = in_double = False
    for i, ch in enumerate(line):
        if ch == "'" and not in_double:
            in_single = not in_single
        elif ch == '"' and not in_single:
            in_double = not in_double
        elif ch == "#" and not in_single and not in_double and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(doc: Path) -> list[Command]:
    rel = str(doc.relative_to(REPO))
    out: list[Command] = []
    for start, body in _blocks(doc.read_text()):
        i = 0
        while i < len(body):
            first, text = i, _strip_comment(body[i])
            comment = body[i][len(text) :].strip()
            on_cluster, resumes = comment.startswith("# cluster:"), comment.startswith("# resumes")
            external = comment.startswith("# needs:")
            while text.endswith("\\") and i + 1 < len(body):
                i += 1
                text = text[:-1].rstrip() + " " + _strip_comment(body[i]).strip()
            i += 1
            if not text.strip():
                continue
            expect = ""
            if i < len(body) and (m := FAIL_COMMENT.match(body[i].strip())):
                expect = f"exit {m.group(2)}" if m.group(2) else (m.group(1) + m.group(3)).strip()
            for part in (p.strip() for p in text.split(" && ")):
                if part:
                    out.append(
                        Command(
                            rel,
                            start + first,
                            part,
                            "cluster" if on_cluster else "external" if external else kind_of(part),
                            expect,
                            resumes,
                        )
                    )
    return out


def all_commands() -> list[Command]:
    return [c for d in docs() for c in commands(d)]

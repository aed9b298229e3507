"""The code blocks of the project's Markdown documents, and how each one is run.

A fenced block's info string says its language. Every block is run by
tests/docs/test_snippets.py, top to bottom, against a fresh server, unless it says
otherwise. What a block may say, in an HTML comment on the line just before it:

    <!-- snippet: skip: REASON -->       never run; the reason is required
    <!-- snippet: spark -->              a PySpark block: run where `spark` is a SparkSession,
                                         as in the `pyspark` shell
    <!-- snippet: until interrupted -->  a Python block that runs until Ctrl-C (a worker loop):
                                         it is interrupted once it is running

A block whose info string is `text` is a listing or a diagram, not code. A shell
command that follows a stream until Ctrl-C says so in its comment (`# ... Ctrl-C`)
and is interrupted the same way. In a shell block written as a session (`$ command`
lines followed by what they print), the printed output is checked too.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The documents whose blocks must run, in the order a reader meets them.
DOCUMENTS = [
    "README.md",
    "docs/API.md",
    "docs/HTTP.md",
    "docs/CLIENTS.md",
    "docs/OPERATIONS.md",
    "docs/SPARK.md",
    "docs/FORMAT.md",
    "docs/DURABILITY.md",
    "docs/PERFORMANCE.md",
    "docs/RELIABILITY.md",
    "docs/CLUSTER.md",
    "docs/ARCHITECTURE.md",
    "clients/node/README.md",
]
# Every document of docs/ must be in the list above: a new one is not forgotten.
assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} <= set(DOCUMENTS)

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<marker>.*?)\s*-->\s*$")
MARKERS = ("spark", "until interrupted")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str  # "" when none

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def kind(self) -> str:
        """How the block is run: skip, text, python, spark, sh, js or settings."""
        if self.marker.startswith("skip"):
            reason = self.marker.removeprefix("skip").lstrip(":").strip()
            if not reason:
                raise ValueError(f"{self.where}: a skipped block needs a reason (skip: REASON)")
            return "skip"
        if self.marker and self.marker not in MARKERS:
            raise ValueError(f"{self.where}: unknown marker {self.marker!r}")
        if self.language == "text":
            return "text"
        if self.language == "python":
            return "spark" if self.marker == "spark" else "python"
        if self.language in ("sh", "js"):
            return self.language
        if self.language == "toml" and self.code.startswith("# streamlog.toml"):
            return "settings"
        raise ValueError(
            f"{self.where}: a {self.language or 'plain'} block cannot be run: give it a language the "
            "test runs (python, sh, js, toml for a streamlog.toml), `text` for a listing, or a marker "
            "<!-- snippet: skip: REASON -->"
        )


def blocks(document: str) -> list[Block]:
    """The fenced blocks of a document, in order, with the marker before each."""
    lines = (REPO / document).read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        indent = len(fence["indent"])
        start = index
        body: list[str] = []
        index += 1
        while not lines[index].strip().startswith("```"):
            body.append(lines[index][indent:])
            index += 1
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = _MARKER.match(previous)
        language = fence["info"].split()[0] if fence["info"].strip() else ""
        code = "\n".join(body) + "\n"
        found.append(Block(document, start + 1, language, code, marker["marker"] if marker else ""))
        index += 1
    return found


@dataclass(frozen=True)
class Command:
    text: str
    expected: str | None  # what a `$ command` session shows it printing; None: not shown

    @property
    def until_interrupted(self) -> bool:
        """A command that follows a stream says so: `# ... Ctrl-C`."""
        return "Ctrl-C" in self.text


def _complete(text: str) -> bool:
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def commands(code: str) -> list[Command]:
    """The commands of a shell block, each with the output shown for it in a `$` session."""
    lines = code.splitlines()
    session = any(line.startswith("$ ") for line in lines)
    found: list[Command] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if session and not line.startswith("$ "):
            continue  # output, collected with its command below
        text = line[2:] if session else line
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        while not _complete(text) and index < len(lines):
            text += "\n" + lines[index]
            index += 1
        expected = None
        if session:
            shown = []
            while index < len(lines) and not lines[index].startswith("$ "):
                shown.append(lines[index])
                index += 1
            expected = "\n".join(shown).strip()
        found.append(Command(text, expected))
    return found

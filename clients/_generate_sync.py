"""Generate the sync client (clients/client.py) from the async one (clients/aio.py).

    python clients/_generate_sync.py           # write clients/client.py (make gen does it)
    python clients/_generate_sync.py --check   # exit 1 when clients/client.py is stale

The async client is the one source, as in httpcore (whose scripts/unasync.py this
follows): every line of clients/aio.py is rewritten by the substitutions below
(`async def` -> `def`, `await x` -> `x`, `AsyncClient` -> `Client`, `grpc.aio` ->
`grpc`, ...), a few sentences of the docs that differ are swapped, and ruff formats
the result. Docstrings go through the same substitutions, so their examples read
right in both. The streaming calls, which do differ, are written for each flavour
(clients/_streaming_aio.py, clients/_streaming_sync.py) and only their import is
rewritten here. A substitution or sentence that no longer matches anything is an
error, so this table cannot rot unnoticed. The generated file is not committed (the
repository holds one source); it is run as a script, since importing the `clients`
package needs the file it writes.

Why not the `unasync` package: it rewrites names token by token, so it leaves
docstrings and `grpc.aio.` attribute chains alone, and both need rewriting here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent
SOURCE = CLIENTS / "aio.py"
TARGET = CLIENTS / "client.py"

HEADER = (
    "# Generated from clients/aio.py by clients/_generate_sync.py (`make gen`); not committed.\n"
    "# Do not edit: change clients/aio.py, and make regenerates this file.\n"
)

# Sentences of the async client's docs that say something else for the sync one: each
# must occur exactly once in clients/aio.py.
SENTENCES = [
    (
        '"""The asyncio streamlog client (grpc.aio).\n',
        '"""The synchronous streamlog client.\n',
    ),
    (
        '"""A grpc.aio connection to one streamlog server; the same API as Client, with `await`.\n'
        "\n"
        "    Create it inside a running event loop (grpc.aio channels belong to one loop).\n",
        '"""A connection to one streamlog server. Thread-safe; use one per process and share it.\n',
    ),
]

# Regular expressions, applied line by line in this order where no letter, digit or _ comes
# just before: each must match somewhere.
SUBSTITUTIONS = [
    ("async def", "def"),
    ("async with", "with"),
    # `(await self.call(...)).field` -> `self.call(...).field`, without the parentheses.
    (r"\(await (self\.\w+\([^()]*\))\)", r"\1"),
    ("await ", ""),
    ("__aenter__", "__enter__"),
    ("__aexit__", "__exit__"),
    (r"grpc\.aio", "grpc"),
    (r"clients\._streaming_aio", "clients._streaming_sync"),
    ("Async([A-Z][A-Za-z0-9_]*)", r"\1"),
]
_COMPILED = [(re.compile(rf"(?<!\w){pattern}"), replacement) for pattern, replacement in SUBSTITUTIONS]


def _substituted(line: str, used: set[int]) -> str:
    for index, (pattern, replacement) in enumerate(_COMPILED):
        line, count = pattern.subn(replacement, line)
        if count:
            used.add(index)
    return line


def _formatted(source: str) -> str:
    """`source` as ruff formats it (the project's formatter, with the project's settings)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(TARGET), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=CLIENTS.parent,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ruff format failed on the generated client: {result.stderr.strip()}")
    return result.stdout


def generate(source: str) -> str:
    """The sync client's source made from the async client's."""
    for old, new in SENTENCES:
        if source.count(old) != 1:
            raise ValueError(f"the async client should say this exactly once: {old!r}")
        source = source.replace(old, new)
    used: set[int] = set()
    lines = [_substituted(line, used) for line in source.splitlines(keepends=True)]
    unused = [SUBSTITUTIONS[i][0] for i in range(len(SUBSTITUTIONS)) if i not in used]
    if unused:
        raise ValueError(f"substitutions that match nothing in the async client: {unused}")
    return _formatted(HEADER + "".join(lines))


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python clients/_generate_sync.py [--check]", file=sys.stderr)
        return 2
    made = generate(SOURCE.read_text())
    if check:
        if TARGET.read_text() != made:
            print(f"{TARGET} is stale: run `make gen`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(made)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""How tests/docs/snippets.py reads a document: what runs, what is checked, what must be marked."""

from __future__ import annotations

import pytest

from tests.docs import snippets
from tests.docs.snippets import Block, blocks, commands


def block(language: str, code: str, marker: str = "") -> Block:
    return Block("doc.md", 1, language, code, marker)


def test_blocks_carry_their_language_indentation_and_marker(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(snippets, "REPO", tmp_path)
    (tmp_path / "doc.md").write_text(
        "Text.\n\n<!-- snippet: skip: needs a cluster -->\n```go\nx := 1\n```\n\n"
        "- a list item:\n\n  ```python\n  print(1)\n  ```\n"
    )
    found = blocks("doc.md")
    assert [(b.line, b.language, b.code, b.marker, b.kind) for b in found] == [
        (4, "go", "x := 1\n", "skip: needs a cluster", "skip"),
        (10, "python", "print(1)\n", "", "python"),
    ]


@pytest.mark.parametrize(
    ("language", "code", "marker", "message"),
    [
        ("go", "x := 1\n", "", "a go block cannot be run"),
        ("", "a listing\n", "", "a plain block cannot be run"),
        ("toml", "tokens = []\n", "", "a toml block cannot be run"),
        ("sh", "make run\n", "skip", "a skipped block needs a reason"),
        ("python", "print(1)\n", "sometimes", "unknown marker 'sometimes'"),
    ],
)
def test_a_block_that_cannot_run_must_say_why(language: str, code: str, marker: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assert block(language, code, marker).kind


def test_a_shell_session_pairs_each_command_with_what_it_prints() -> None:
    session = """$ grpcurl -plaintext -d '{"stream": "s",
    "count": 1}' \\
  localhost:7070 streamlog.v1.StreamLogService/Read
{
  "next_offset": "0"
}

$ grpcurl -plaintext localhost:7070 list    # no output shown
$ streamlog tail -f s    # until Ctrl-C
"""
    found = commands(session)
    assert [c.text.splitlines()[-1].strip() for c in found] == [
        "localhost:7070 streamlog.v1.StreamLogService/Read",
        "grpcurl -plaintext localhost:7070 list    # no output shown",
        "streamlog tail -f s    # until Ctrl-C",
    ]
    assert found[0].expected == '{\n  "next_offset": "0"\n}'
    assert found[1].expected == "" and not found[1].until_interrupted
    assert found[2].until_interrupted


def test_a_plain_shell_block_is_one_command_per_logical_line() -> None:
    found = commands("# a comment\nstreamlog append s a \\\n  b\necho 'two\nlines'\n")
    assert [c.text for c in found] == ["streamlog append s a \\\n  b", "echo 'two\nlines'"]
    assert all(c.expected is None for c in found)

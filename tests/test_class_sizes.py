"""No class in storage/ or service/ grows past 400 lines (issue 14): a class that large does
several jobs, and the cluster work lands in these two layers. Split it along its seams, as
storage/stream.py (nodewriter.py, reader.py, streaminfo.py) and storage/engine.py
(streamsapi.py, maintenance.py) were."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 400


def class_sizes(directory: Path) -> dict[str, int]:
    """Lines of every class under `directory` (its decorators to its last statement, nested
    classes too), by path:name."""
    sizes = {}
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                sizes[f"{path.relative_to(directory)}:{node.name}"] = node.end_lineno - first + 1
    return sizes


@pytest.mark.parametrize("package", ["storage", "service"])
def test_no_class_is_over_400_lines(package: str) -> None:
    sizes = class_sizes(ROOT / package)
    assert sizes, f"no class found under {package}/"
    too_big = {name: lines for name, lines in sizes.items() if lines > MAX_CLASS_LINES}
    assert not too_big, f"classes over {MAX_CLASS_LINES} lines: {too_big}"


def test_the_measure_counts_a_class_from_its_decorators_to_its_end(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "@decorate\nclass A:\n    x = 1\n\n    class B:\n        pass\n\n    def f(self):\n        return 2\n"
    )
    assert class_sizes(tmp_path) == {"m.py:A": 9, "m.py:B": 2}

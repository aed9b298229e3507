"""pyspark_streamlog.compile_workers: bytecode beside each source of a zip, used by zipimport."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from pyspark_streamlog.compile_workers import compile_zip, pyspark_zip


def _import_value(path: Path) -> str:
    code = f"import sys; sys.path.insert(0, {str(path)!r}); import pkg.mod as m; print(m.VALUE, m.__file__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_a_zip_gets_bytecode_beside_each_source_that_imports_use(tmp_path: Path) -> None:
    path = tmp_path / "lib.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/mod.py", "VALUE = 'compiled'\n")
        z.writestr("pkg/data.txt", "kept")
    assert compile_zip(path) == 2
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        assert names == ["pkg/__init__.py", "pkg/__init__.pyc", "pkg/mod.py", "pkg/mod.pyc", "pkg/data.txt"]
        assert z.read("pkg/data.txt") == b"kept"
        pyc = z.read("pkg/mod.pyc")
    # The bytecode is what is imported: a zip whose source says otherwise still gives its value.
    swapped = tmp_path / "swapped.zip"
    with zipfile.ZipFile(swapped, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/mod.py", "VALUE = 'source'\n")
        z.writestr("pkg/mod.pyc", pyc)
    value, file = _import_value(swapped).split()
    assert value == "compiled" and file.endswith("mod.pyc")
    assert compile_zip(path) == 0  # once is enough


def test_the_installed_pyspark_zip_holds_bytecode_after_make_venv() -> None:
    path = pyspark_zip()
    assert path is not None, "PySpark 4 ships python/lib/pyspark.zip"
    with zipfile.ZipFile(path) as z:
        assert "pyspark/worker.pyc" in z.namelist(), "run `python -m pyspark_streamlog.compile_workers`"

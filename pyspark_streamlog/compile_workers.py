"""Put bytecode into PySpark's pyspark.zip, so that the Python processes Spark starts import
it without compiling it first:

    python -m pyspark_streamlog.compile_workers      # the make venv step runs it

Spark puts `$SPARK_HOME/python/lib/pyspark.zip` first on its Python workers' path. The zip
holds sources only, and zipimport never writes bytecode, so every such process compiles what
it imports: about 1.3 s of CPU for a streaming source's planner process here, against 0.5 s
with bytecode. Spark waits a fixed 10 s for that process to connect back (PySpark 4.3's
PythonStreamingSourceRunner; no setting changes it), which a loaded machine can pass.

The zip is rewritten with a `.pyc` beside each `.py`, the layout zipimport reads. They are
unchecked hash-based (PEP 552): valid whatever the entries' timestamps. The sources, their
order on the path and the zip's other entries stay as they were. A zip that already holds
bytecode is left alone.
"""

from __future__ import annotations

import py_compile
import tempfile
import warnings
import zipfile
from pathlib import Path


def pyspark_zip() -> Path | None:
    """The pyspark.zip Spark's workers import from (None if this PySpark ships none)."""
    import pyspark

    path = Path(pyspark.__file__).parent / "python" / "lib" / "pyspark.zip"
    return path if path.is_file() else None


def compile_zip(path: Path) -> int:
    """Add an unchecked hash-based `.pyc` beside every `.py` of the zip at `path`, replacing the
    file atomically; the number added (0 if it held bytecode already)."""
    with zipfile.ZipFile(path) as original:
        infos = original.infolist()
        if any(info.filename.endswith(".pyc") for info in infos):
            return 0
        with tempfile.TemporaryDirectory() as scratch:
            compiled = {}
            for info in infos:
                if not info.filename.endswith(".py"):
                    continue
                source = Path(scratch, info.filename)
                source.parent.mkdir(parents=True, exist_ok=True)
                source.write_bytes(original.read(info))
                target = str(source) + "c"
                with warnings.catch_warnings():  # PySpark's own tests carry a few SyntaxWarnings
                    warnings.simplefilter("ignore", SyntaxWarning)
                    py_compile.compile(
                        str(source),
                        cfile=target,
                        dfile=f"{path}/{info.filename}",
                        doraise=True,
                        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                    )
                compiled[info.filename] = Path(target).read_bytes()
            rewritten = path.with_name(path.name + ".tmp")
            with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as out:
                for info in infos:
                    out.writestr(info, original.read(info))
                    if info.filename in compiled:
                        out.writestr(info.filename + "c", compiled[info.filename])
    rewritten.replace(path)
    return len(compiled)


def main() -> None:
    path = pyspark_zip()
    if path is None:
        print("no pyspark.zip in this PySpark: nothing to do")
        return
    added = compile_zip(path)
    print(f"{path}: {added} modules compiled" if added else f"{path}: holds bytecode already")


if __name__ == "__main__":
    main()

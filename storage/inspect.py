"""Offline inspector for segment files and data directories.

    python -m storage.inspect PATH           list segments and nodes (PATH: data dir, stream dir or .seg file;
                                             a data dir's streams in slots of pack files too)
    python -m storage.inspect verify DATA    check every stream; exit status 1 if anything is damaged
    python -m storage.inspect packs DATA     list pack files: slots used, free, damaged; check each slot
    python -m storage.inspect unpack DATA [--segment-bytes SIZE]
                                             move every stream out of pack files, then remove them;
                                             SIZE: the server's segment_bytes (default 64MiB)
    add --json for one JSON object per line

All but `unpack` only read: safe to run beside a live server (the active node may then
show as still being written). `unpack` opens the directory as the engine does (storage/unpack.py)
and is refused while a server holds it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from storage import grouplog
from storage.config import EngineConfig
from storage.dedup import ProducerTable
from storage.engine import Engine
from storage.errors import CorruptionError, DurabilityError, PreconditionError
from storage.format import NODE_SPARSE, NODE_ZSTD, SLOT_SEGMENT_BYTES, SegmentHeader
from storage.fs import FileSystem
from storage.layout import (
    DAMAGED_SUFFIX,
    META_FILE,
    META_NEW,
    PACKS_DIR,
    PRODUCERS_FILE,
    SEGMENT_SUFFIX,
    pack_name,
    read_meta,
    streams_root,
)
from storage.packinspect import inspect_packs
from storage.packs import Packs, split_place
from storage.segment import Segment


@dataclass
class NodeReport:
    base_offset: int
    count: int
    end_offset: int
    min_ts: int
    max_ts: int
    stored_bytes: int
    raw_bytes: int
    compressed: bool
    crc_ok: bool

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass
class SegmentReport:
    path: str
    base_offset: int
    packed: bool
    file_bytes: int
    nodes: list[NodeReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def inspect_segment(path: Path) -> SegmentReport:
    try:
        segment, cut = Segment.open(FileSystem(), path, writable=False, verify=False)
    except (CorruptionError, OSError, ValueError) as exc:
        return SegmentReport(str(path), -1, False, path.stat().st_size, problems=[f"unreadable: {exc}"])
    return _report(segment, cut, str(path))


def _report(segment: Segment, cut: str | None, where: str) -> SegmentReport:
    """The report of an open segment (closed here), `cut` the reason its chain stopped short, if it did."""
    report = SegmentReport(where, segment.base_offset, segment.packed, segment.file.size)
    if cut:
        report.problems.append(cut)
    try:
        for ref in segment.nodes:
            h = ref.header
            tables = 2 if h.flags & NODE_SPARSE else 1
            raw = 4 * h.count * tables + h.blob_len
            try:
                segment.read_body(ref, None)
                ok = True
            except CorruptionError as exc:
                ok = False
                report.problems.append(f"node {h.base_offset}..{ref.end_offset}: {exc}")
            if segment.packed:
                slots = segment.file.read(ref.pos, 2 * 64)
                if slots[:64] != slots[64:]:
                    where = f"node {h.base_offset}..{ref.end_offset}"
                    report.problems.append(f"{where}: one header copy is damaged")
            stored = h.stored_len if segment.packed else raw
            report.nodes.append(
                NodeReport(
                    h.base_offset,
                    h.count,
                    ref.end_offset,
                    h.min_ts,
                    h.max_ts,
                    stored,
                    raw,
                    bool(h.flags & NODE_ZSTD),
                    ok,
                )
            )
    finally:
        segment.close()
    return report


def _slot_reports(data_dir: Path) -> Iterator[SegmentReport]:
    """A report per stream in a slot of a pack file, as its header names it (damaged slot headers
    are `packs`' and `verify`'s to report)."""
    packs = Packs(FileSystem(), data_dir)
    try:
        for place, header, _ in packs.scan():
            pack, slot, _ = split_place(place)
            where = f"{data_dir / PACKS_DIR / pack_name(pack)} slot {slot} (stream {header.name!r})"
            try:
                segment, cut = Segment.over(packs.open_slot(place, header.name, writable=False), verify=False)
            except CorruptionError as exc:
                yield SegmentReport(where, -1, False, SLOT_SEGMENT_BYTES, problems=[f"unreadable: {exc}"])
                continue
            yield _report(segment, cut, where)
    except (CorruptionError, DurabilityError) as exc:
        problem = f"pack files unreadable: {exc}"
        yield SegmentReport(str(data_dir / PACKS_DIR), -1, False, 0, problems=[problem])
    finally:
        packs.close()


def _reports_under(path: Path) -> Iterator[SegmentReport]:
    """The segments under PATH (a .seg file, a stream's directory or a data directory), reported."""
    for segment_path in _segments_under(path):
        yield inspect_segment(segment_path)
    if (path / PACKS_DIR).is_dir():
        yield from _slot_reports(path)


def _segments_under(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    streams = streams_root(path)
    dirs = sorted(streams.iterdir()) if streams.is_dir() else [path]
    for directory in dirs:
        yield from sorted(directory.glob(f"*{SEGMENT_SUFFIX}"))


def verify(data_dir: Path) -> list[str]:
    """Every problem found in a data directory, as sentences; empty when all is well."""
    problems: list[str] = []
    streams = streams_root(data_dir)
    if not streams.is_dir():
        return [f"{data_dir} is not a streamlog data directory (no streams/)"]
    for directory in sorted(p for p in streams.iterdir() if p.is_dir()):
        # A new stream has no meta file, or stream.meta.new until its first sync (storage/creation.py).
        has_meta = (directory / META_FILE).exists() or (directory / META_NEW).exists()
        no_segment = not any(directory.glob(f"*{SEGMENT_SUFFIX}"))
        set_aside = sorted(p.name for p in directory.glob(f"*{SEGMENT_SUFFIX}{DAMAGED_SUFFIX}"))
        if no_segment and set_aside:  # the stream is unreadable, its directory kept (storage/loader.py)
            problems.append(f"{directory.name}: no readable segment; set aside: {', '.join(set_aside)}")
            continue
        if not has_meta and no_segment:
            continue  # a stream creation a crash cut short: start-up removes it, nothing was in it
        try:
            name, _, _ = read_meta(FileSystem(), directory)
        except (OSError, CorruptionError, ValueError, KeyError) as exc:
            problems.append(f"{directory.name}: metadata unreadable: {exc}")
            continue
        problems.extend(f"stream {name!r}: {p}" for p in _side_file_problems(directory))
        expected = None
        for path in sorted(directory.glob(f"*{SEGMENT_SUFFIX}")):
            report = inspect_segment(path)
            problems.extend(f"stream {name!r} {path.name}: {p}" for p in report.problems)
            if (
                expected is not None
                and 0 <= report.base_offset < expected
                and _ends_by(path, report, expected)
            ):
                problems.append(
                    f"stream {name!r} {path.name}: lies inside the segment before it, the leftover of a "
                    "merge that a crash interrupted (start-up removes it)"
                )
                continue
            if expected is not None and report.base_offset != expected and report.base_offset >= 0:
                problems.append(
                    f"stream {name!r} {path.name}: starts at {report.base_offset}, expected {expected}"
                )
            if report.nodes:
                expected = report.nodes[-1].end_offset
            if report.packed:
                expected = _packed_end(path, expected)
    problems.extend(inspect_packs(data_dir)[1])
    return problems


def _side_file_problems(directory: Path) -> list[str]:
    """Checks of the files beside the segments: group snapshot and journal, producer table."""
    problems = []
    producers = directory / PRODUCERS_FILE
    if producers.exists():
        try:
            ProducerTable(1, 1, 1).load(producers.read_bytes())
        except CorruptionError as exc:
            problems.append(f"{producers.name}: {exc} (start-up rebuilds it from the stream)")
    snapshot = directory / grouplog.SNAPSHOT_FILE
    if snapshot.exists():
        try:
            generation, _, _ = grouplog.decode_snapshot(snapshot.read_bytes())
        except CorruptionError as exc:
            return [*problems, f"{snapshot.name}: {exc} (consumer groups of this stream are unreadable)"]
        journal = directory / grouplog.journal_name(generation)
        if not journal.exists():
            problems.append(f"{journal.name} is missing (the snapshot names it)")
        else:
            _, records, _, cut = grouplog.scan_journal(journal.read_bytes(), generation)
            if cut is not None:
                problems.append(f"{journal.name}: {cut}; {records} records before it are kept")
    return problems


def _ends_by(path: Path, report: SegmentReport, offset: int) -> bool:
    """Whether the segment covers no offset at or after `offset`."""
    end = _packed_end(path, None) if report.packed else report.nodes[-1].end_offset if report.nodes else None
    return end is not None and end <= offset


def _packed_end(path: Path, fallback: int | None) -> int | None:
    try:
        with path.open("rb") as f:
            return SegmentHeader.decode(f.read(64)).end_offset
    except CorruptionError:
        return fallback


def _print_report(report: SegmentReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(report)))
        return
    kind = "packed" if report.packed else "growing"
    nodes = len(report.nodes)
    print(f"{report.path}  base={report.base_offset}  {kind}  {report.file_bytes} bytes  {nodes} nodes")
    columns = ("base", "count", "end", "min_ts", "max_ts", "stored", "ratio")
    widths = (12, 6, 12, 14, 14, 9, 6)
    print("  " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)) + "  crc")
    for n in report.nodes:
        print(
            f"  {n.base_offset:>12} {n.count:>6} {n.end_offset:>12} {n.min_ts:>14} {n.max_ts:>14} "
            f"{n.stored_bytes:>9} {n.ratio:>6.2f}  {'ok' if n.crc_ok else 'BAD'}"
        )
    for problem in report.problems:
        print(f"  problem: {problem}")


def _print_packs(data_dir: Path, as_json: bool) -> int:
    reports, problems = inspect_packs(data_dir)
    for r in reports:
        if as_json:
            print(json.dumps({**asdict(r), "free": r.free}))
        else:
            unnamed = f" ({r.unnamed} in no catalog row: freed at the next start-up)" if r.unnamed else ""
            print(
                f"pack {r.pack_id:05d}  {r.file_bytes} bytes  {r.slots} slots: "
                f"{r.used} used, {r.free} free, {r.damaged} damaged{unnamed}"
            )
    for problem in problems:
        print(json.dumps({"problem": problem}) if as_json else f"problem: {problem}")
    if not reports and not as_json:
        print(f"no pack files in {data_dir}")
    return 1 if problems else 0


# The range of segment_bytes `streamlog serve` takes (service/config.py), and the units of a size.
_SEGMENT_BYTES_RANGE = (1 << 20, 1 << 40)
_SIZE = re.compile(r"^\s*(\d+)\s*(|B|KiB|MiB|GiB)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def segment_bytes(text: str) -> int:
    """--segment-bytes: bytes, with an optional unit KiB, MiB or GiB, in the range the server
    takes (argparse reports an ArgumentTypeError as a usage error, exit 2)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected bytes with an optional unit KiB, MiB or GiB, got {text!r}"
        )
    size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    low, high = _SEGMENT_BYTES_RANGE
    if not low <= size <= high:
        raise argparse.ArgumentTypeError(f"segment_bytes is 1 MiB to 1 TiB ({low} to {high}), got {text!r}")
    return size


def unpack_config(segment_bytes: int) -> EngineConfig:
    """The engine of an unpack: the promoted streams' segments get `segment_bytes` as their
    capacity, the size they grow to (their header's: a server's own setting does not change it).
    It appends nothing, so its batch limits are the smallest: any segment size the server takes
    passes the check that a full batch fits one (the server's own limits passed it)."""
    return EngineConfig(
        background=False,
        segment_bytes=segment_bytes,
        max_batch_entries=1,
        max_batch_bytes=1,
        max_entry_bytes=1,
    )


def _unpack(data_dir: Path, as_json: bool, segment_bytes: int) -> int:
    """Run storage/unpack.py's unpack on a stopped server's directory and say what it did: 0 when
    no stream is left in a slot, 1 when some could not be moved, 2 when it could not run."""
    if not streams_root(data_dir).is_dir():
        print(f"{data_dir} is not a streamlog data directory (no streams/)", file=sys.stderr)
        return 2
    try:
        engine = Engine(data_dir, unpack_config(segment_bytes))
    except PreconditionError as exc:  # its LOCK is held
        print(f"{exc}: stop the server first", file=sys.stderr)
        return 2
    try:
        done = engine.unpack()
    finally:
        engine.close()
    if as_json:
        print(json.dumps({**asdict(done), "promoted": len(done.promoted), "segment_bytes": segment_bytes}))
    else:
        print(f"moved {len(done.promoted)} streams from slots of pack files to directories of their own")
        size = f"{segment_bytes >> 20} MiB" if segment_bytes % (1 << 20) == 0 else f"{segment_bytes} bytes"
        print(f"their segments grow to {size} (segment_bytes: --segment-bytes)")
        print(f"removed {', '.join(done.removed) or 'no pack file'}")
        for name in done.unreadable:
            print(f"problem: stream {name!r} is unreadable in its slot (see the log): left there")
        if done.kept:
            print(f"problem: kept in {data_dir / PACKS_DIR}: {', '.join(done.kept)}")
        else:
            print(f"done: no stream is in a slot; a release before format 6 can open {data_dir}")
    return 1 if done.unreadable or done.kept else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="+", metavar="[verify|packs|unpack] PATH")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--segment-bytes",
        type=segment_bytes,
        metavar="SIZE",
        help="unpack: the server's segment_bytes, the size a moved stream's segment grows to "
        f"(default {EngineConfig().segment_bytes >> 20}MiB, the server's default)",
    )
    ns = parser.parse_args(argv)
    if ns.segment_bytes is not None and ns.args[0] != "unpack":
        parser.error("--segment-bytes is for unpack")
    if ns.args[0] == "verify":
        if len(ns.args) != 2:
            parser.error("verify takes one data directory")
        problems = verify(Path(ns.args[1]))
        for problem in problems:
            print(json.dumps({"problem": problem}) if ns.json else f"problem: {problem}")
        if not problems and not ns.json:
            print("ok: no damage found")
        return 1 if problems else 0
    if ns.args[0] == "packs":
        if len(ns.args) != 2:
            parser.error("packs takes one data directory")
        return _print_packs(Path(ns.args[1]), ns.json)
    if ns.args[0] == "unpack":
        if len(ns.args) != 2:
            parser.error("unpack takes one data directory")
        return _unpack(Path(ns.args[1]), ns.json, ns.segment_bytes or EngineConfig().segment_bytes)
    status = 0
    for arg in ns.args:
        path = Path(arg)
        if not path.exists():
            print(f"no such file or directory: {path}", file=sys.stderr)
            status = 2
            continue
        for report in _reports_under(path):
            _print_report(report, ns.json)
            if report.problems:
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())

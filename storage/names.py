"""Names: the rule for stream, group and consumer names, and the directory a stream is stored under.

A name never becomes a path as it is. Bytes outside [A-Za-z0-9_-] are
percent-encoded, so `../x` and `a/b` are ordinary names; a name whose encoding
would be too long for a file name is stored under the SHA-256 of its bytes,
behind a `~` that the percent form never produces. A percent-form directory
name gives the name back (`name_of_dirname`), so a new stream needs no meta file
(storage/creation.py); a hashed one's name is kept in its meta file.
"""

from __future__ import annotations

import hashlib
import string

from storage.errors import InvalidArgumentError

MAX_NAME_BYTES = 255
_MAX_DIRNAME = 200
HASHED = "~"  # starts a directory name that is a name's hash: it does not give the name back
_SAFE = frozenset((string.ascii_letters + string.digits + "_-").encode())
_SAFE_BYTES = bytes(sorted(_SAFE))  # for bytes.translate, which drops them in C


class InvalidNameError(InvalidArgumentError):
    """A name that breaks the naming rule; `problem` says how (after the name's label)."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(f"{kind} name {problem}")
        self.problem = problem


def validate_name(name: str, kind: str = "stream") -> bytes:
    """The UTF-8 bytes of a stream, group or consumer name (`kind`), which is 1..255 bytes of
    UTF-8 with no NUL; InvalidNameError saying what is wrong otherwise. The one place of the rule:
    the service checks the names of requests with it too."""
    if not isinstance(name, str):
        raise InvalidNameError(kind, "must be a string")
    try:
        raw = name.encode()
    except UnicodeEncodeError:
        raise InvalidNameError(kind, "is not valid UTF-8") from None
    if not raw:
        raise InvalidNameError(kind, "must not be empty")
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidNameError(kind, f"is {len(raw)} bytes; the limit is {MAX_NAME_BYTES}")
    if b"\x00" in raw:
        raise InvalidNameError(kind, "must not contain NUL")
    return raw


def dirname_for(name: str) -> str:
    raw = validate_name(name)
    # Most names are safe as they are: checked in C, not byte by byte (a new stream's path).
    encoded = name if not raw.translate(None, _SAFE_BYTES) else _percent_encoded(raw)
    if len(encoded) <= _MAX_DIRNAME:
        return encoded
    return HASHED + hashlib.sha256(raw).hexdigest()


def _percent_encoded(raw: bytes) -> str:
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)


def name_of_dirname(dirname: str) -> str | None:
    """The name a directory name encodes, or None when it encodes none: a hashed name (`~`), or
    one `dirname_for` would not have written (the two must agree, byte for byte)."""
    if not dirname or len(dirname) > _MAX_DIRNAME or HASHED in dirname:
        return None
    raw = bytearray()
    i = 0
    try:
        while i < len(dirname):
            if dirname[i] == "%":
                raw.append(int(dirname[i + 1 : i + 3], 16))
                i += 3
            else:
                raw.append(ord(dirname[i]))
                i += 1
        name = raw.decode()
        return name if dirname_for(name) == dirname else None
    except (ValueError, InvalidArgumentError):
        return None

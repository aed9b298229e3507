"""Stream names: validation, and the directory name each one is stored under.

A name never becomes a path as it is. Bytes outside [A-Za-z0-9_-] are
percent-encoded, so `../x` and `a/b` are ordinary names; a name whose encoding
would be too long for a file name is stored under the SHA-256 of its bytes,
behind a `~` that the percent form never produces. The real name is kept in
the stream's metadata.
"""

from __future__ import annotations

import hashlib
import string

from storage.errors import InvalidArgumentError

MAX_NAME_BYTES = 255
_MAX_DIRNAME = 200
_SAFE = frozenset((string.ascii_letters + string.digits + "_-").encode())


def validate_name(name: str) -> bytes:
    """The name's UTF-8 bytes, or InvalidArgumentError saying what is wrong."""
    if not isinstance(name, str):
        raise InvalidArgumentError("stream name must be a string")
    try:
        raw = name.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError("stream name is not valid UTF-8") from exc
    if not raw:
        raise InvalidArgumentError("stream name must not be empty")
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidArgumentError(f"stream name is {len(raw)} bytes; the limit is {MAX_NAME_BYTES}")
    if b"\x00" in raw:
        raise InvalidArgumentError("stream name must not contain NUL")
    return raw


def dirname_for(name: str) -> str:
    raw = validate_name(name)
    encoded = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(encoded) <= _MAX_DIRNAME:
        return encoded
    return "~" + hashlib.sha256(raw).hexdigest()

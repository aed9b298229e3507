"""Pages of stream names: ListStreams and DescribeCluster list streams the same way.

Names are listed in code point order (the byte order of their UTF-8 encoding), from
a prefix, `page_size` at a time; a page token is the last name of the previous page,
encoded, so any node of a cluster continues a listing another node started.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Sequence
from typing import Any

from service import validation
from service.config import Settings
from service.errors import invalid_argument
from storage import MAX_NAME_BYTES

_PAGE_TOKEN_PREFIX = b"streamlog.v1/streams\x00"


def _page_token(name: str) -> str:
    """The token of the page that follows the one ending with stream `name`."""
    return base64.urlsafe_b64encode(_PAGE_TOKEN_PREFIX + name.encode()).decode()


def _after_token(token: str) -> str:
    """The last name of the previous page, from a token this server issued."""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if not raw.startswith(_PAGE_TOKEN_PREFIX):
            raise ValueError(token)
        return raw[len(_PAGE_TOKEN_PREFIX) :].decode()
    except (ValueError, UnicodeError):
        raise invalid_argument("page_token: not a token this server issued") from None


def page_of_names(request: Any, names: Sequence[str], settings: Settings) -> tuple[list[str], str]:
    """One page of `names` (sorted) for a request with `prefix`, `page_size` and `page_token`:
    the names and the token of the next page ("" on the last)."""
    prefix = request.prefix
    if len(prefix.encode()) > MAX_NAME_BYTES:
        raise invalid_argument(f"prefix: longer than a stream name can be ({MAX_NAME_BYTES} bytes)")
    page_size = validation.bounded(
        "page_size", request.page_size, settings.default_page_size, settings.max_page_size
    )
    start = bisect.bisect_left(names, prefix)
    if request.page_token:
        start = max(start, bisect.bisect_right(names, _after_token(request.page_token)))
    page: list[str] = []
    for name in names[start : start + page_size + 1]:
        if not name.startswith(prefix):
            break
        page.append(name)
    more = len(page) > page_size
    del page[page_size:]
    return page, _page_token(page[-1]) if more else ""

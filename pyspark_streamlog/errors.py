"""The errors the connector raises. Spark shows their messages inside its own exceptions.

Each message names what was wrong and what to do about it, because the person
reading it sees a Spark stack trace first and this text somewhere inside.
"""

from __future__ import annotations


class StreamlogSparkError(Exception):
    """Base class of the connector's errors."""


class OptionError(StreamlogSparkError, ValueError):
    """An option is missing, unknown, malformed or contradicts another."""


class EndpointError(StreamlogSparkError, ConnectionError):
    """The server cannot be reached (or refuses the calls) at the configured endpoint."""


class StreamNotFoundError(StreamlogSparkError, LookupError):
    """A stream named in the options does not exist on the server."""


class DataLossError(StreamlogSparkError):
    """Entries the query needs are gone (evicted, corrupt), and failOnDataLoss is true."""


class ServerError(StreamlogSparkError):
    """The server answered a call with an error the connector does not handle itself."""

"""What went wrong reading object storage, and how to say it without its credentials.

URLs in every message are redacted (user info and query string removed:
:func:`redact`); an error is told transient (retried), permanent (a 403, a
404, a bad range: not retried) or a store that cannot be reached at all
(:class:`StoreUnavailableError`, which stops a run whatever ``on_error`` says).
:mod:`echo_native.remote` retries and reports with these.
"""
from __future__ import annotations

import errno
import re

from echo_native.errors import ReadLimitError


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def is_url(location) -> bool:
    """True for ``scheme://...`` other than ``file://`` (which is read as a local path)."""
    if not isinstance(location, str):
        return False
    m = _SCHEME.match(location)
    return bool(m) and m.group(1).lower() != "file"


def local_path(location):
    """``file:///x`` -> ``/x``; anything else unchanged (a str or os.PathLike)."""
    if isinstance(location, str) and location[:7].lower() == "file://":
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(location).path)
    return location


def redact(url: str) -> str:
    """``url`` without user info, query string or fragment: safe to show and log."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _redact_text(text: str) -> str:
    """Every URL inside ``text`` redacted (backends put request URLs in their messages)."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


class RemoteReadError(OSError):
    """Reading an object failed for good: a permanent error (403, 404, a deleted
    object) or transient errors that outlasted the retry budget.

    ``filename`` names the object (its URL, redacted, and the member key where
    there is one), ``strerror`` says what went wrong; ``str()`` is both."""

    def __str__(self):
        return f"{self.filename}: {self.strerror}" if self.filename else str(self.strerror)


class StoreUnavailableError(RemoteReadError):
    """The store itself could not be reached: every try of a read failed before the
    store answered (connection refused, no such host), until the retry budget ran out.

    This is not one object's failure, so it is not a sample failure either: the
    pipeline stops with it whatever ``on_error`` says (trying other samples of a
    store that is down would only spend the budget again for each).  ``endpoint``
    is the store (redacted), ``filename`` the object that was being read."""

    def __init__(self, code, strerror, filename=None, endpoint=None):
        super().__init__(code, strerror, filename)
        self.endpoint = endpoint

    def __reduce__(self):  # crosses process and thread boundaries with its endpoint
        return (type(self), (self.errno, self.strerror, self.filename, self.endpoint))


_PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSYS,
                     errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EFBIG}

# Errors that mean no connection to the store was made: the store is down (or its
# name is wrong), not one object.  By errno, and by the backends' type names
# (aiohttp, botocore), which are matched by name so that neither is imported here.
_UNREACHABLE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                       errno.EHOSTDOWN, errno.ENETDOWN}
_UNREACHABLE_TYPES = {"ClientConnectorError", "ClientConnectorDNSError",
                      "EndpointConnectionError", "ConnectTimeoutError", "NameResolutionError"}
# Configuration errors of a backend: no retry finds credentials that are not there.
_CONFIG_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError",
                  "InvalidURL"}
_TIMEOUTS = ("TimeoutError", "FSTimeoutError", "ReadTimeoutError", "AioReadTimeoutError",
             "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError")


def _chain(e):
    """``e`` and the errors behind it (cause, context, aiohttp's ``os_error``)."""
    seen = []
    while e is not None and len(seen) < 16 and not any(e is s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__ or getattr(e, "os_error", None)
    return seen


def unreachable(e: BaseException) -> bool:
    """True when ``e`` says no connection reached the store (refused, no such host)."""
    import socket

    for x in _chain(e):
        if isinstance(x, (ConnectionRefusedError, socket.gaierror)):
            return True
        if type(x).__name__ in _UNREACHABLE_TYPES:
            return True
        if isinstance(x, OSError) and x.errno in _UNREACHABLE_ERRNOS:
            return True
    return False


def _status(e):
    """The HTTP status an error carries, if any (aiohttp, requests, botocore)."""
    status = getattr(e, "status", None) or getattr(e, "status_code", None)
    if isinstance(status, int):
        return status
    meta = (getattr(e, "response", None) or {})
    if isinstance(meta, dict):
        status = (meta.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _effective(e):
    """The error that says what happened.  fsspec's HTTP filesystem reports every
    failure of ``info()`` (a refused connection, an HTTP 500) as FileNotFoundError,
    with the real error as its cause: only a 404 (or 410) there means missing."""
    while isinstance(e, FileNotFoundError) and e.__cause__ is not None \
            and not isinstance(e.__cause__, FileNotFoundError) \
            and _status(e.__cause__) not in (404, 410):
        cause = e.__cause__
        if _status(cause) is None and not unreachable(cause) and not _is_timeout(cause) \
                and not isinstance(cause, OSError):
            break  # a backend's own "not found" with some other cause: trust it
        e = cause
    return e


def _is_timeout(e):
    return any(isinstance(x, TimeoutError) or type(x).__name__ in _TIMEOUTS for x in _chain(e))


def is_permanent(e: BaseException) -> bool:
    """True when retrying ``e`` cannot help (a missing or forbidden object, a bad request)."""
    e = _effective(e)
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                      NotADirectoryError, ReadLimitError, RemoteReadError)):
        return True
    if isinstance(e, (ValueError, TypeError, NotImplementedError)) \
            or type(e).__name__ in _CONFIG_ERRORS:
        return True
    if isinstance(e, (TimeoutError, ConnectionError)) or unreachable(e):
        return False
    status = _status(e)
    if isinstance(status, int):
        return 400 <= status < 500 and status not in (408, 429)
    if isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS:
        return True
    return False


def _error_text(e: BaseException, timeout=None) -> str:
    e = _effective(e)
    status = _status(e)
    if isinstance(e, FileNotFoundError):
        what = "no such object (deleted?)"
    elif isinstance(e, PermissionError):
        what = "access denied"
    elif status is not None:
        reason = getattr(e, "message", None) or getattr(e, "reason", None)
        what = f"HTTP {status} {reason}" if isinstance(reason, str) and reason \
            else f"HTTP {status}: {e}"
        return " ".join(_redact_text(what).split())[:300]
    elif unreachable(e):
        cause = next((x for x in reversed(_chain(e)) if isinstance(x, OSError)), e)
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
            what = "connection refused"
        elif type(cause).__name__ == "gaierror":
            what = "no such host (name resolution failed)"
        else:
            what = "cannot connect"
        detail = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        detail = " ".join(_redact_text(detail).split())[:300]
        return f"{what}: {detail}" if detail else what
    elif _is_timeout(e):
        return (f"no answer within {timeout:.1f} s" if timeout is not None
                else "no answer in time")
    else:
        what = type(e).__name__
    detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    detail = " ".join(_redact_text(detail).split())[:300]
    return f"{what}: {detail}" if detail else what


def _errno_of(e):
    e = _effective(e)
    if isinstance(e, FileNotFoundError):
        return errno.ENOENT
    if isinstance(e, PermissionError):
        return errno.EACCES
    if isinstance(e, ReadLimitError):
        return e.errno or errno.EFBIG
    return errno.EIO

"""Remote access via fsspec: resolve URLs, retry transient errors, redact secrets, name temps.

Every remote call in feedpipe and ckpt goes through :func:`call`, which retries transient
failures (timeouts, connection resets, 5xx / SlowDown) with exponential backoff and full jitter
until a deadline, and fails at once on permanent ones (404 / NoSuchKey / NoSuchBucket, 403 /
AccessDenied). Errors are :class:`RemoteIOError` (or the subclass the caller names) naming the
URL; their text and every log line are passed through :func:`redact`, so credentials from
``storage_options`` never leak. Standard library and fsspec only: no torch, no numpy, nothing
else from feedpipe.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_POLICY",
    "TEMP_PREFIX",
    "CancelledError",
    "RemoteIOError",
    "RetryPolicy",
    "call",
    "classify",
    "is_remote",
    "is_s3_url",
    "is_temp",
    "is_unreachable",
    "is_url",
    "join",
    "local_file_path",
    "redact",
    "resolve",
    "temp_name",
    "temp_target",
    "within",
]

log = logging.getLogger("feedpipe.remote")

T = TypeVar("T")

_LOCAL_PROTOCOLS = {"file", "local"}
_SECRET_KEYS = re.compile(r"secret|token|passw|key|credential|session|auth|sig", re.I)
# userinfo runs to the last "@" of the authority (a raw "@" in a password is common)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/?#\s\\]*@", re.I)
# a password with a raw "/", "?" or "#" (unencoded, but users write them): "user:" first, then
# everything up to the "@" (may over-redact "host:port/path@x", never under-redact)
_URL_USERINFO_RAW = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/?#\s\\:@]*:[^\s'\"\\]*@", re.I)
# userinfo with no scheme, as libraries quote a bucket or host they could not parse (botocore:
# 'Invalid bucket name "KEY:SECRET@bucket"'): a "name:" token, then everything up to the last "@"
# before a space or quote ("//" after the colon is a scheme, left to the two rules above)
_BARE_USERINFO = re.compile(r"(?<![^\s'\"(\[{<=,])[\w.%+~-]+:(?!//)[^\s'\"]*@")
# a query/fragment parameter whose name says it is a credential (X-Amz-Signature, sig, token,
# access_token, AWSAccessKeyId, api_key, password, ...): its value goes
_QUERY_SECRETS = re.compile(
    r"(?<![^?&;#\s'\"(,{])(?P<name>[^=&?#;/\s'\"]*(?:signature|credential|security-token|token|"
    r"accesskey|access_key|api_key|apikey|secret|passw|sig|auth|key)[^=&?#;/\s'\"]*)"
    r"=[^&#\s'\"]*",
    re.I,
)
_PERMANENT_CODES = {
    "NoSuchKey",
    "NoSuchBucket",
    "NotFound",
    "404",
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidBucketName",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "503",
    "500",
    "502",
    "504",
}


class CancelledError(Exception):
    """Raised inside a transfer when its caller cancelled it (e.g. on Ctrl-C)."""


class RemoteIOError(OSError):
    """A remote call failed; the message names the URL and says whether retries were exhausted.

    Its text and ``url`` pass through :func:`redact`. feedpipe raises its subclass
    :class:`feedpipe.errors.RemoteError` (also a ``DatasetError``); ckpt raises this class.
    """

    def __init__(self, message: str, url: str, *, permanent: bool = False) -> None:
        super().__init__(redact(message))
        self.url = redact(url)
        self.permanent = permanent

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (loader workers)
        return (type(self), (str(self), self.url), {"permanent": self.permanent})


def is_url(text: str | os.PathLike[str]) -> bool:
    """True for a URL of any protocol (``s3://``, ``file://``...): text with ``://`` in it."""
    return "://" in os.fspath(text)


def is_s3_url(url: str | os.PathLike[str]) -> bool:
    """True for an S3 URL (``s3://`` or ``s3a://``)."""
    return os.fspath(url).startswith(("s3://", "s3a://"))


def is_remote(url: str | os.PathLike[str]) -> bool:
    """True for a URL with a non-local protocol (``s3://``, ``gs://``, ``http://``...)."""
    text = os.fspath(url)
    if not is_url(text):
        return False
    return text.split("://", 1)[0].lower() not in _LOCAL_PROTOCOLS


def local_file_path(url: str | os.PathLike[str]) -> str:
    """The local path a ``file://`` URL names; any other path or URL is returned unchanged.

    One rule for every entry point of feedpipe and ckpt that takes a local path (RFC 8089):
    ``file:///abs`` and ``file://localhost/abs`` are ``/abs`` (the scheme and ``localhost`` in any
    case). Anything else that starts with ``file:/`` is a ``ValueError`` naming the (redacted)
    URL: another host (``file://host/abs`` is not a path on this machine, and a relative path
    never follows ``file://``), no path at all (``file://``), and ``file:/abs``, which is what
    ``Path`` makes of both ``file:///abs`` and ``file://localhost/abs`` and so is ambiguous.
    ``file:name`` (no slash) is a relative path like any other. The path is taken literally, as
    fsspec's local filesystem does: no percent-decoding (``file:///a%20b`` is ``/a%20b``) and
    ``?`` and ``#`` are part of it.
    """
    text = os.fspath(url)
    if text[:6].lower() != "file:/":
        return text
    if text[:7].lower() == "file://":
        host, slash, rest = text[7:].partition("/")
        local = host.lower() in ("", "localhost")
        if local and slash and rest.strip("/"):
            return "/" + rest
        why = (
            "names no path"
            if local
            else "names another host (only file:///abs and file://localhost/abs are local)"
        )
    else:
        why = "is ambiguous (write file:///abs for /abs)"
    raise ValueError(f"{redact(text)!r}: this file: URL {why}")


def resolve(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    deadline_s: float | None = None,
) -> tuple[Any, str]:
    """Return ``(filesystem, root path)`` for a URL or local path (``file://`` included).

    With ``deadline_s``, one attempt of a call cannot outlast it: for S3, botocore's connect and
    read timeouts are capped by it and botocore and s3fs make one attempt each (retrying is left
    to :func:`call`, which stops at the deadline); for HTTP, aiohttp's connect and read timeouts
    are capped. Explicit ``config_kwargs`` / ``client_kwargs`` entries win.
    """
    import fsspec.core

    text = local_file_path(url)  # file:// URLs by one rule (fsspec reads file://host/x as host/x)
    if text[:5].lower() == "file:":  # file:name is the relative path ./file:name, as for open()
        text = os.path.abspath(text)  # (fsspec would read it as ./name)
    options = dict(storage_options or {})
    _redact_library_logs()
    if is_s3_url(text):
        _require("s3fs", "s3")
        # every file is verified end to end against the index's CRC32C, so botocore's own
        # response checksum (pure Python without awscrt) is redundant, and slow: see the
        # staging section of docs/benchmarks.md
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("response_checksum_validation", "when_required")
        if deadline_s is not None:
            config.setdefault("connect_timeout", max(0.5, min(5.0, deadline_s / 2)))
            config.setdefault("read_timeout", max(0.5, min(15.0, deadline_s)))
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
    elif text.startswith(("http://", "https://")) and deadline_s is not None:
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault(
            "timeout",
            aiohttp.ClientTimeout(
                sock_connect=max(0.5, min(5.0, deadline_s / 2)),
                sock_read=max(0.5, min(15.0, deadline_s)),
            ),
        )
        options["client_kwargs"] = client
    try:
        fs, path = fsspec.core.url_to_fs(text, **options)
    except ValueError as exc:  # e.g. an unknown protocol: the message may quote the URL
        raise ValueError(redact(str(exc), storage_options)) from None
    if deadline_s is not None and hasattr(fs, "retries"):
        # s3fs retries inside each call (up to 5 times, read timeout each); the options above
        # make this instance (cached per options) specific to this deadline
        fs.retries = 1
    return fs, path.rstrip("/") or path


def join(root: str, relpath: str) -> str:
    """Join a root (URL or path) and a dataset-relative posix path."""
    return f"{root.rstrip('/')}/{relpath.lstrip('/')}"


def _encoded(secret: str) -> set[str]:
    """``secret`` as it is written and as a URL or a form writes it (AWS secret keys hold
    ``/`` and ``+``: a signed URL or a library's message shows ``%2F``, ``%2B``)."""
    from urllib.parse import quote, quote_plus

    forms = {secret, quote(secret, safe=""), quote(secret), quote_plus(secret)}
    return forms | {re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), f) for f in forms}


def _secret_values(options: Mapping[str, Any] | None) -> Iterator[str]:
    if not options:
        return
    for key, value in options.items():
        if isinstance(value, Mapping):
            yield from _secret_values(value)
        elif _SECRET_KEYS.search(str(key)):
            values = value if isinstance(value, (list, tuple)) else [value]
            yield from (v for v in values if isinstance(v, str) and len(v) >= 4)
    # the standard environment credentials are secrets too
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        value = os.environ.get(name, "")
        if len(value) >= 8:
            yield value


def redact(text: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Remove credentials: secret ``storage_options`` values, URL userinfo (with or without
    its scheme), signed query strings.

    Every URL on its way into a message, ``repr``, log record or status file passes through here
    (``DatasetError`` applies it to its own message).
    """
    text = str(text)
    secrets = {form for s in _secret_values(storage_options) for form in _encoded(s)}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _URL_USERINFO_RAW.sub(lambda m: m.group("scheme") + "***@", text)
    text = _URL_USERINFO.sub(lambda m: m.group("scheme") + "***@", text)
    text = _BARE_USERINFO.sub("***@", text)
    return _QUERY_SECRETS.sub(lambda m: m.group("name") + "=***", text)


class _RedactFilter(logging.Filter):
    """Passes every record through :func:`redact` (fsspec logs each URL it opens at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        clean = redact(text)
        if clean != text:
            record.msg, record.args = clean, None
        return True


# a filter applies to the records of the logger it is on, not of its children: name each one
_LIBRARY_LOGGERS = ("fsspec", "fsspec.http", "fsspec.cached", "fsspec.local", "s3fs", "gcsfs")
_REDACT_FILTER = _RedactFilter()


def _redact_library_logs() -> None:
    """Make the storage libraries' own log records safe (idempotent)."""
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if _REDACT_FILTER not in logger.filters:
            logger.addFilter(_REDACT_FILTER)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__])


def _code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None)
    if not isinstance(response, Mapping):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code, int(status or 0)


def classify(exc: BaseException) -> str:
    """``"permanent"``, ``"transient"`` or ``"unknown"`` for an fsspec/s3fs/botocore exception."""
    names: set[str] = set()
    for e in _chain(exc):
        code, status = _code(e)
        if code in _PERMANENT_CODES or status in (403, 404):
            return "permanent"
        if code in _TRANSIENT_CODES or status >= 500:
            return "transient"
        if isinstance(
            e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
        ):
            return "permanent"
        if isinstance(e, (TimeoutError, socket.timeout, ConnectionError)):
            return "transient"
        names.update(c.__name__ for c in type(e).__mro__)
    transient_types = {
        "HTTPClientError",  # botocore: connection reset / closed / read timeout
        "ConnectionClosedError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteRead",
        "ResponseStreamingError",
        "FSTimeoutError",
        "ClientPayloadError",  # aiohttp
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ResponseParserError",
    }
    if names & transient_types:
        return "transient"
    for e in _chain(exc):
        text = str(e)
        if any(
            w in text
            for w in ("SlowDown", "503", "Service Unavailable", "reduce your request rate")
        ):
            return "transient"
    return "unknown"


def is_unreachable(exc: BaseException) -> bool:
    """True when the host cannot be reached at all: the connection was refused, or its name
    does not resolve (a temporary DNS failure, ``EAI_AGAIN``, is not this)."""
    for e in _chain(exc):
        if isinstance(e, ConnectionRefusedError):
            return True
        if isinstance(e, socket.gaierror) and e.errno in (socket.EAI_NONAME, socket.EAI_NODATA):
            return True
    return False


class RetryPolicy:
    """Exponential backoff with full jitter under an overall deadline (per call).

    ``retry_unreachable=False`` fails at once when the host is unreachable
    (:func:`is_unreachable`): right for a first contact, where a refused connection is a wrong
    URL or a server that is down, not a blip worth minutes of retries."""

    def __init__(
        self,
        deadline_s: float = 120.0,
        base_s: float = 0.1,
        max_sleep_s: float = 5.0,
        *,
        retry_unreachable: bool = True,
    ) -> None:
        if deadline_s <= 0 or base_s <= 0 or max_sleep_s <= 0:
            raise ValueError("deadline_s, base_s and max_sleep_s must be positive")
        self.deadline_s = deadline_s
        self.base_s = base_s
        self.max_sleep_s = max_sleep_s
        self.retry_unreachable = retry_unreachable

    def sleep_for(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based): uniform in [0, cap]."""
        cap = min(self.max_sleep_s, self.base_s * 2 ** (attempt - 1))
        return random.uniform(cap / 2, cap)


DEFAULT_POLICY = RetryPolicy()


class _Attempts:
    """The attempts of one :func:`call`: each failure is given up on (raising ``error``) or
    paused after, until the policy's deadline."""

    def __init__(
        self,
        url: str,
        *,
        what: str,
        policy: RetryPolicy,
        storage_options: Mapping[str, Any] | None,
        error: type[RemoteIOError],
        cancel: threading.Event | None,
    ) -> None:
        self.url, self.what, self.policy = url, what, policy
        self.options, self.error, self.cancel = storage_options, error, cancel
        self.start = time.monotonic()
        self.attempt = 0

    def begin(self) -> None:
        """The next attempt starts (unless cancelled: :class:`CancelledError`)."""
        self.attempt += 1
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(redact(self.url, self.options))

    def failed(self, exc: Exception) -> float:
        """The attempt raised ``exc``: raise the error to give up with, or return the pause
        before the next attempt."""
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(redact(self.url, self.options)) from None
        kind = classify(exc)
        detail = redact(f"{type(exc).__name__}: {exc}", self.options)
        safe_url = redact(self.url, self.options)
        head = f"cannot {self.what} {safe_url}"
        if kind == "transient" and not self.policy.retry_unreachable and is_unreachable(exc):
            raise self.error(
                f"{head}: the host is unreachable: {detail}", safe_url, permanent=False
            ) from None
        if kind != "transient":
            reason = "permanent error" if kind == "permanent" else "error"
            raise self.error(
                f"{head}: {reason}: {detail}", safe_url, permanent=kind == "permanent"
            ) from None
        elapsed = time.monotonic() - self.start
        pause = self.policy.sleep_for(self.attempt)
        if elapsed + pause > self.policy.deadline_s:
            raise self.error(
                f"{head}: still failing after {self.attempt} attempts in {elapsed:.1f} s "
                f"(deadline {self.policy.deadline_s:g} s): {detail}",
                safe_url,
                permanent=False,
            ) from None
        # one warning per call, at its first retry; the rest at DEBUG (a dead endpoint
        # would otherwise print a line per attempt until the deadline)
        log.log(
            logging.WARNING if self.attempt == 1 else logging.DEBUG,
            "transient error on %s (attempt %d), retrying in %.2f s until the %g s deadline: %s",
            safe_url,
            self.attempt,
            pause,
            self.policy.deadline_s,
            detail,
        )
        return pause

    def pause(self, seconds: float) -> None:
        if self.cancel is not None:
            self.cancel.wait(seconds)
        else:
            time.sleep(seconds)


def call(
    fn: Callable[[], T],
    url: str,
    *,
    what: str = "read",
    policy: RetryPolicy | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_retry: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
    error: type[RemoteIOError] = RemoteIOError,
) -> T:
    """Run ``fn()``; retry transient errors until ``policy.deadline_s``; raise ``error``.

    ``error`` is :class:`RemoteIOError` or a subclass (feedpipe passes its ``RemoteError``).

    ``on_retry`` runs before each retry (e.g. to roll back a progress bar or remove a partial file).
    ``cancel``, once set, stops the retries (and the pause between them): :class:`CancelledError`.
    """
    attempts = _Attempts(
        url,
        what=what,
        policy=policy or DEFAULT_POLICY,
        storage_options=storage_options,
        error=error,
        cancel=cancel,
    )
    while True:
        attempts.begin()
        try:
            return fn()
        except CancelledError:
            raise
        except Exception as exc:
            pause = attempts.failed(exc)
        if on_retry is not None:
            on_retry()
        attempts.pause(pause)


# Temp files are named TEMP_PREFIX + "BYTES.PID.RAND." + final name. No dataset file may start
# with TEMP_PREFIX (an index listing one is refused), so a temp is never a dataset file and a
# dataset file (``x.part.1.data`` included) is never taken for a temp and deleted.
TEMP_PREFIX = ".feedpipe-tmp."


def _require(module: str, extra: str) -> None:
    """Import an optional dependency or raise ``ImportError`` naming the extra to install.

    feedpipe's own entry points check first with :func:`feedpipe.errors.require`, which raises
    the ``MissingExtraError`` subclass with the same message.
    """
    try:
        importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{module!r} is required for this feature: pip install 'feedpipe[{extra}]'"
        ) from exc


def within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` on a daemon thread; :class:`TimeoutError` if it has not returned in ``seconds``.

    The calling thread polls, so Ctrl-C is seen at once; a call still hanging is abandoned.
    """
    box: dict[str, Any] = {}

    def _run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=_run, name="feedpipe-remote-call", daemon=True)
    thread.start()
    end = time.monotonic() + max(0.0, seconds)
    while thread.is_alive():
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {max(0.0, seconds):.1f} s")
        thread.join(min(0.2, left))
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def temp_name(final: str, nbytes: int) -> str:
    """A temp path beside ``final`` that is never a dataset file; it records size and pid."""
    head, tail = os.path.split(final)
    rand = uuid.uuid4().hex[:8]
    return os.path.join(head, f"{TEMP_PREFIX}{nbytes}.{os.getpid()}.{rand}.{tail}")


def is_temp(name: str) -> bool:
    """True if the file name ``name`` is one of :func:`temp_name`'s."""
    return temp_target(name) is not None


def temp_target(name: str) -> tuple[str, int, int] | None:
    """``(final name, declared bytes, pid)`` of a :func:`temp_name` file name, else None."""
    if not name.startswith(TEMP_PREFIX):
        return None
    fields = name[len(TEMP_PREFIX) :].split(".", 3)
    if len(fields) != 4 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return fields[3], int(fields[0]), int(fields[1])

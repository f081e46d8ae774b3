"""Queue and result-store URLs: split qworker's own query parameters from the client library's,
read typed parameter values, and redact secrets before anything is logged or shown.

The bottom floor of the worker's URL handling: it imports nothing of qworker but its error base,
so that every backend (qworker/backends/) and every opener can use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from qworker.errors import QworkerError

T = TypeVar("T")


class InvalidURLError(QworkerError, ValueError):
    """A queue or result URL that qworker cannot use."""


@dataclass
class ParsedURL:
    scheme: str
    # The URL without qworker's own query parameters: what the client library connects to.
    connection_url: str
    params: dict[str, str]


def url_scheme(url: str) -> str:
    return urlsplit(url).scheme


def query_params(url: str) -> dict[str, str]:
    """Every query parameter of `url` (the last value of a repeated name)."""
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def query_names(url: str) -> list[str]:
    return [k for k, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)]


def schemes_text(schemes: Iterable[str]) -> str:
    """'redis://, sqs:// or memory://'."""
    names = [f"{scheme}://" for scheme in schemes]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:password|passwd|secret|token)[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` fit to log or show: the password in user:password@ and any password=/secret=/token=
    query value replaced by ***."""
    if not url:
        return "(embedded Redis)"
    scheme, sep, rest = url.partition("://")
    if sep:
        end = min([i for i in (rest.find(c) for c in "/?#") if i != -1], default=len(rest))
        netloc, tail = rest[:end], rest[end:]
        userinfo, at, host = netloc.rpartition("@")
        if at and ":" in userinfo:
            url = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}{tail}"
    return _SECRET_QUERY.sub(r"\1***", url)


def parse_url(url: str, known_params: set[str]) -> ParsedURL:
    """Split qworker's own query parameters (`known_params`) from the rest."""
    parts = urlsplit(url)
    if not parts.scheme:
        raise InvalidURLError(f"URL {redact_url(url)!r} has no scheme; use redis://host:port/db?stream=...")
    query = parse_qsl(parts.query, keep_blank_values=True)
    params = {k: v for k, v in query if k in known_params}
    rest = [(k, v) for k, v in query if k not in known_params]
    # Rebuilt by hand: urlunsplit turns unix:///path into unix:/path.
    base = url.split("?", 1)[0]
    connection_url = f"{base}?{urlencode(rest)}" if rest else base
    return ParsedURL(parts.scheme, connection_url, params)


def _is_accepted(name: str, accepted: set[str]) -> bool:
    return name in accepted or any(p.endswith("*") and name.startswith(p[:-1]) for p in accepted)


def reject_unknown_params(
    url: str, names: Iterable[str], own: set[str], library: tuple[str, set[str]] | None = None
) -> None:
    """Raise InvalidURLError naming each query parameter in `names` that is neither one of
    qworker's (`own`) nor one the client library takes (`library`: its name and parameters;
    a name ending in * is a prefix)."""
    library_params = library[1] if library is not None else set()
    unknown = [n for n in dict.fromkeys(names) if n not in own and not _is_accepted(n, library_params)]
    if not unknown:
        return
    accepted = f"qworker's: {', '.join(sorted(own)) or '(none)'}"
    if library is not None:
        accepted += f"; {library[0]}'s: {', '.join(sorted(library_params))}"
    raise InvalidURLError(
        f"unknown URL parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
        f"in {redact_url(url)!r}. Accepted ({accepted})"
    )


def named_location(url: str, own: set[str], what: str) -> tuple[str, dict[str, str]]:
    """(name, params) of a URL that names its queue or bucket in its host part (and, for the
    in-memory backend, its path), with only qworker's parameters `own`. `what`: the words for
    the error when it names none ("queue; use memory://NAME")."""
    parts = urlsplit(url)
    params = query_params(url)
    reject_unknown_params(url, params, own)
    name = parts.netloc + parts.path
    if not name:
        raise InvalidURLError(f"URL {redact_url(url)!r} names no {what}")
    return name, params


def _url_value(params: dict[str, str], name: str, parse: Callable[[str], T], what: str) -> T | None:
    """URL parameter `name` parsed by `parse`; None when absent."""
    if name not in params:
        return None
    try:
        return parse(params[name])
    except ValueError:
        raise InvalidURLError(f"URL parameter {name}={params[name]!r} is not {what}") from None


def url_number(params: dict[str, str], name: str, default: float) -> float:
    value = _url_value(params, name, float, "a number")
    return default if value is None else value


def url_integer(params: dict[str, str], name: str) -> int | None:
    """An optional integer URL parameter; None when absent."""
    return _url_value(params, name, int, "an integer")


def url_flag(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidURLError(f"URL parameter {name}={value!r} is not a boolean")

"""Text from request headers, decoded as UTF-8.

HTTP header values are bytes; Starlette's ``request.headers`` decodes them as Latin-1, so a user
id sent as UTF-8 (``X-User-Id: jürgen``) would arrive as ``jÃ¼rgen``: another user.
"""

from __future__ import annotations

from starlette.requests import Request

from inferscale_engine.errors import InferScaleError


class HeaderEncodingError(InferScaleError):
    """A header whose value is not valid UTF-8 (the client's error: a 400)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the {name} header is not valid UTF-8")
        self.header = name


def header_text(request: Request, name: str) -> str | None:
    """The first ``name`` header of ``request`` decoded as UTF-8; None when absent or empty.

    Raises:
        HeaderEncodingError: the value is not valid UTF-8.
    """
    key = name.lower().encode("latin-1")
    for k, v in request.headers.raw:
        if k.lower() == key:
            try:
                return v.decode("utf-8") or None
            except UnicodeDecodeError:
                raise HeaderEncodingError(name) from None
    return None


def user_id_header(request: Request) -> str | None:
    """The ``X-User-Id`` header, decoded as UTF-8 (None when absent or empty).

    Raises:
        HeaderEncodingError: the value is not valid UTF-8.
    """
    return header_text(request, "X-User-Id")

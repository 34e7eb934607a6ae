"""The memory store of a running ``inferscale serve``, reached over its HTTP API.

``inferscale memory ...`` uses it when a server holds the store's lock (or with ``--server``):
:class:`RemoteMemory` offers the part of :class:`~inferscale_engine.memory.MemoryStore`'s API the
commands need and returns the same :class:`~inferscale_engine.memory.MemoryItem` records, so
their output is the same either way. It speaks the server's Mem0 platform routes
(``inferscale_apps/server/mem0_api.py``) with the standard library only: no vLLM, no extra
dependency, fast start.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from inferscale_engine.errors import FactNotFoundError, InferScaleError
from inferscale_engine.memory.item import MemoryItem


class RemoteMemory:
    """Memories of a server at ``url`` (``http://host:port``), sent ``Bearer api_key`` if given."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 300.0) -> None:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--server must be an http:// or https:// URL, got {url!r}")
        self.url = url
        self._api_key = api_key
        self._timeout = timeout

    def add_texts(self, texts: Sequence[str], *, user_id: str,
                  metadata: Sequence[dict[str, Any] | None] | None = None) -> list[MemoryItem]:
        """Store each text as it is (``infer=false``: no model extraction), in one request, as
        :meth:`MemoryStore.add_texts <inferscale_engine.memory.MemoryStore.add_texts>` does.
        The server's add takes one metadata for the request, so every text's must be the same."""
        metas = {json.dumps(m or {}, sort_keys=True) for m in metadata or [None]}
        if len(metas) > 1:
            raise ValueError("a server stores one metadata for all texts of an add")
        body: dict[str, Any] = {"messages": [{"role": "user", "content": t} for t in texts], "user_id": user_id,
                                "infer": False}
        meta = json.loads(metas.pop())
        if meta:
            body["metadata"] = meta
        return [self._item(m) for m in self._call("POST", "/v1/memories/", body=body)["results"]]

    def search(self, query: str, *, user_id: str, k: int = 5) -> list[MemoryItem]:
        body = {"query": query, "user_id": user_id, "top_k": k}
        return [self._item(m) for m in self._call("POST", "/v1/memories/search/", body=body)["results"]]

    def get_all(self, *, user_id: str) -> list[MemoryItem]:
        return [self._item(m) for m in self._call("GET", "/v1/memories/", query={"user_id": user_id})["results"]]

    def get(self, fact_id: str, *, user_id: str) -> MemoryItem:
        """One memory of ``user_id``; :class:`FactNotFoundError` if there is none with that id."""
        try:
            return self._item(self._call("GET", f"/v1/memories/{_quote(fact_id)}/", query={"user_id": user_id}))
        except FactNotFoundError:
            raise FactNotFoundError(f"no memory {fact_id!r} for user {user_id!r}") from None

    def delete(self, fact_id: str, *, user_id: str) -> None:
        try:
            self._call("DELETE", f"/v1/memories/{_quote(fact_id)}/", query={"user_id": user_id})
        except FactNotFoundError:
            raise FactNotFoundError(f"no memory {fact_id!r} for user {user_id!r}") from None

    def delete_all(self, *, user_id: str) -> int:
        return int(self._call("DELETE", "/v1/memories/", query={"user_id": user_id}).get("deleted", 0))

    def close(self) -> None:
        """Nothing to release (one connection per request); here so callers treat both alike."""

    def __enter__(self) -> RemoteMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP

    def _call(self, method: str, path: str, *, body: Any = None, query: dict[str, str] | None = None) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:  # noqa: S310  (http(s) checked above)
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code == 404:
                raise FactNotFoundError(message) from None
            if exc.code == 401:
                raise InferScaleError(f"the server at {self.url} needs its API key: pass --api-key KEY or set "
                                      "INFERSCALE_API_KEY") from None
            raise InferScaleError(f"the server at {self.url} refused {method} {path} ({exc.code}): {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InferScaleError(f"no InferScale server answers at {self.url} ({reason}); start one with "
                                  "`inferscale serve`, or leave out --server (and INFERSCALE_SERVER) to open the "
                                  "store folder directly") from None

    @staticmethod
    def _item(m: dict[str, Any]) -> MemoryItem:
        return MemoryItem(id=m["id"], memory=m["memory"], user_id=m.get("user_id") or "", handle=m.get("handle", ""),
                          score=m.get("score"), metadata=dict(m.get("metadata") or {}),
                          created_at=m.get("created_at") or "", updated_at=m.get("updated_at") or "")


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's own words: OpenAI-style ``error.message`` or Mem0's ``detail``."""
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return str(exc.reason)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(exc.reason)

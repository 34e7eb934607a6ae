"""What tests of the integrations may reset and look at that their public classes do not offer
(the engine's own hooks are :mod:`inferscale_engine.testing`).

The integrations keep state per process (the engines :func:`~inferscale_integrations.get_engine`
shares, the warnings given once per class): a test that needs a fresh process's behaviour resets
it here instead of reaching into their private module. Importing this module imports no
framework.
"""

from __future__ import annotations

from typing import Any

from inferscale_integrations import _common

__all__ = ["forget_engines", "forget_shared_user_warnings", "langchain_openai_message"]


def forget_engines() -> None:
    """Drop the engines :func:`~inferscale_integrations.get_engine` shares (without closing
    them): the next one it is asked for is built anew."""
    _common.forget_engines()


def forget_shared_user_warnings() -> None:
    """Each integration class warns once again, as in a fresh process, when it is built without
    ``user_id`` (:class:`~inferscale_engine.errors.SharedUserWarning`)."""
    _common._WARNED_SHARED.clear()


def langchain_openai_message(message: Any) -> dict[str, Any]:
    """A LangChain message as ``ChatInferScale`` sends it to the chat template: an OpenAI-style
    chat message (tool calls' arguments as dicts)."""
    from inferscale_integrations.langchain._messages import openai_message

    return openai_message(message)

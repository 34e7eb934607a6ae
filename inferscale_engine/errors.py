"""Every error InferScale raises on purpose. Each says what was wrong in words a caller can act on."""

from __future__ import annotations

from typing import Any


class InferScaleError(Exception):
    """Base class of InferScale's own errors."""


class HandleError(InferScaleError, ValueError):
    """A memory handle could not be used. Subclasses say why."""


class MalformedHandleError(HandleError):
    """Text looks like a handle but is not one."""


class ForgedHandleError(HandleError, PermissionError):
    """The handle's MAC does not match: forged, altered, or owned by another user."""


class FactNotFoundError(HandleError, LookupError):
    """The handle names a fact that does not exist (never did, or was deleted)."""


class StaleKVError(HandleError):
    """Stored KV was encoded by another model, dtype, rope config or window (fingerprint mismatch)."""


class ContextOverflowError(InferScaleError, ValueError):
    """Prompt (with injected facts) plus ``max_tokens`` does not fit the model's context."""


class InvalidSchemaError(InferScaleError, ValueError):
    """A JSON schema to constrain output with (``response_format``) that is not one: its metaschema
    refuses it, or a ``$ref`` in it leads nowhere."""


class InvalidOptionError(InferScaleError, ValueError):
    """A generation option the engine does not take: an unknown name (the closest known one is
    suggested) or a bad value (``max_tokens=0``, ``recompute=-1``). ``option`` names it."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes, option included
        return _invalid_option, (str(self), self.option)


def _invalid_option(message: str, option: str | None) -> InvalidOptionError:
    return InvalidOptionError(message, option=option)


class EngineSettingsError(InferScaleError, ValueError):
    """vLLM refused an engine setting (``max_model_len`` beyond the model's, an unknown option...)."""


class EngineClosedError(InferScaleError, RuntimeError):
    """The engine was closed."""


class KVNotReadyError(InferScaleError, TimeoutError):
    """A fact's KV is still being encoded in the background and was not ready within the timeout."""


class KVMissingError(InferScaleError, LookupError):
    """No usable KV file for this fact version (never written, deleted, or unreadable)."""


class ModelNotFoundError(InferScaleError, ValueError):
    """A model name is neither an existing directory nor an alias."""


class ModelPreparationError(InferScaleError, RuntimeError):
    """A model cannot be prepared (missing source, bad output)."""


class NonFiniteKVError(InferScaleError, ValueError):
    """KV holding NaN or infinity: it must never reach vLLM's paged cache."""


class MissingUserError(InferScaleError, RuntimeError):
    """A request carries memory handles but names no user to check them against. A
    ``RuntimeError``, not a ``ValueError``: LlamaIndex's response synthesizers swallow the latter
    into an empty answer."""



class SchemaVersionError(InferScaleError, RuntimeError):
    """A memory store's database was written by an InferScale of another schema version."""


class SecretError(InferScaleError):
    """A store's handle secret is missing or is not the one its handles were made with."""


class StoreDamagedError(InferScaleError):
    """A store folder's database is missing, empty or not a SQLite database while the rest of the
    store (handle secret, KV files, write-ahead log) is there: opened, it would start over empty
    and remove every KV file as belonging to no memory, so it is refused. The message says what is
    wrong and the two ways out."""

    def __init__(self, folder: object, problem: str = "its database is missing or damaged",
                 db_file: str = "memory.sqlite3") -> None:
        super().__init__(
            f"memory store {folder} cannot be opened: {problem}. Nothing was changed. Restore {db_file} from a "
            f"backup (first move aside any {db_file}-wal or -shm left there: they belong to the lost file); or, to "
            f"start over with an empty store (every memory in it is lost), delete the folder {folder} or use "
            "another one (--store DIR)")
        self.folder, self.problem, self.db_file = folder, problem, db_file

    def __reduce__(self) -> tuple[type, tuple[object, str, str]]:  # picklable across processes
        return type(self), (self.folder, self.problem, self.db_file)


class TooLargeError(InferScaleError, ValueError):
    """An input over one of the documented size limits (HTTP 413)."""


class StorageFullError(InferScaleError, OSError):
    """The store's disk is full: nothing was written (HTTP 507)."""


class StorageUnavailableError(InferScaleError, OSError):
    """The store's folder cannot be written (read-only, permissions, I/O error) (HTTP 503)."""


class ReplicaMismatchError(InferScaleError):
    """A replica's KV would not be the KV of a shared store: it runs another model (or dtype,
    window, context prefix) than the replicas already serving the store."""


class DatabaseUnavailableError(InferScaleError, ConnectionError):
    """A shared store's database stayed unreachable through every retry, or dropped the
    connection while a write was committing (HTTP 503)."""


class ConnectorError(InferScaleError, RuntimeError):
    """The KV connector inside vLLM found its state inconsistent with the request it serves
    (a span with no KV location, a foreign layer count): a bug or misuse, not bad input."""


def check_utf8(text: str, what: str) -> str:
    """``text`` if it is valid Unicode: lone surrogates cannot be tokenized, embedded or stored,
    and tokenizers reject them with an obscure TypeError. ``what`` names it in the error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text ({exc.reason} at position {exc.start})") from None
    return text


class SharedUserWarning(InferScaleError, UserWarning):
    """An integration class was built without ``user_id``: everyone using it shares the memories
    of user ``"default"``. Warned once per class and process; filter it, or make it an error,
    with :mod:`warnings` (as an error it is an InferScaleError)."""


class RefusedRequestError(InferScaleError, RuntimeError):
    """The engine refused a LlamaIndex ``InferScaleLLM`` call for a reason that is a ``ValueError``
    (:class:`ContextOverflowError`, :class:`FactNotFoundError`, :class:`StaleKVError`...), raised
    as this instead: LlamaIndex's response synthesizers turn ``ValueError``s into the answer
    "Empty Response". The engine's error is its ``__cause__``."""


class HandleOwnerError(InferScaleError, PermissionError):
    """Memory handles in a LlamaIndex ``InferScaleLLM`` prompt are not the LLM's user's (the retriever
    or memory recalled them for another ``user_id``, or they were forged). A ``PermissionError``,
    as the engine's ``ForgedHandleError`` is, but not a ``ValueError``: LlamaIndex's response
    synthesizers turn ``ValueError``s into the answer "Empty Response"."""

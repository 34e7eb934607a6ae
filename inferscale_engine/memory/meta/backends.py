"""Which metadata backend a store's location names: the one module that knows both, above
:mod:`~inferscale_engine.memory.meta.db` (the interface, the shared SQL and SQLite) and
:mod:`~inferscale_engine.memory.meta.pg` (PostgreSQL, built on that shared SQL)."""

from __future__ import annotations

from pathlib import Path

from inferscale_engine.config import is_database_url
from inferscale_engine.memory.meta.db import MetaDB, SQLiteDB
from inferscale_engine.memory.meta.pg import PostgresDB


def open_db(location: str | Path) -> MetaDB:
    """The backend of ``location``: a ``postgresql://`` URL, or the SQLite file of a store folder."""
    if is_database_url(location):
        return PostgresDB(str(location))
    return SQLiteDB(Path(location))

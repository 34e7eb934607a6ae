"""The documented path of :func:`~inferscale_engine.memory.text.splitting.split_facts`
(``docs/memory.md`` until the move into ``memory/text/``), kept so that users' imports still work."""

from inferscale_engine.memory.text.splitting import split_facts

__all__ = ["split_facts"]

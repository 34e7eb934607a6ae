"""A store's metadata: the database behind one interface (:mod:`.db` SQLite, :mod:`.pg`
PostgreSQL, :mod:`.backends` picks one), the store's folder and secret (:mod:`.folder`), the live
facts in memory (:mod:`.facts`) and their per-user vector indexes (:mod:`.index`). Imports
``memory/text`` and the front door's leaf modules (``item``, ``validation``), never ``memory/kv``."""

"""Text in, text out: what a fact is encoded after (:mod:`.context`), splitting a message into
facts (:mod:`.splitting`), Mem0-style extraction (:mod:`.extraction`), relative dates made absolute
(:mod:`.dates`) and sentence embeddings
(:mod:`.embedder`, :mod:`.query_graph`). Imports nothing else of ``memory/`` but the front
door's leaf modules (``item``, ``encoding``)."""

"""A store's KV: the tiers it lives in (:mod:`.tiers` device and host, :mod:`.disk_tier`, copies
by :mod:`.dma`, speeds by :mod:`.bandwidth`) and the keeper that makes, keeps and serves it
(:mod:`.keeper`, fed by :mod:`.encode_queue`). The tier modules import nothing else of
``memory/``; the keeper sits on ``memory/meta`` and ``memory/text``."""

"""A store's KV: the tiers it lives in (one class each behind :mod:`.backend`'s interface:
:mod:`.device_tier`, :mod:`.host_tier` on :mod:`.pages`, :mod:`.disk_tier`; coordinated by
:mod:`.tiers`; copies by :mod:`.dma`, speeds by :mod:`.bandwidth`) and the keeper that makes, keeps and serves it
(:mod:`.keeper`, fed by :mod:`.encode_queue`). The tier modules import nothing else of
``memory/``; the keeper sits on ``memory/meta`` and ``memory/text``."""

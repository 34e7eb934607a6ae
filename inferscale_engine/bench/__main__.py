"""``python -m inferscale_engine.bench``: the same as ``inferscale bench``."""

from inferscale_engine.bench.cli import main

raise SystemExit(main())

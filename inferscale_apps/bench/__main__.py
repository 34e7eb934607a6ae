"""``python -m inferscale_apps.bench``: the same as ``inferscale bench``."""

from inferscale_apps.bench.cli import main

raise SystemExit(main())

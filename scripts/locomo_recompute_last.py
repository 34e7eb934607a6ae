"""LoCoMo with the last memory of each prompt recomputed instead of injected (experiment).

usage: python scripts/locomo_recompute_last.py locomo ARGS...   (the arguments of ``bench locomo``)

Everything up to the last memory is injected as usual; the last memory, the text after it and
the question are prefilled, so that memory's KV sees exactly the memories served before it.
Injected answers are cached under their own key (``inject+last``) next to a run's plain ones,
so pointing ``--workdir`` at an earlier run reuses its stores and prompt answers.
"""

import sys

from inferscale_engine.bench import locomo
from inferscale_engine.bench.__main__ import main
from inferscale_engine.engine import InferScaleEngine
from inferscale_engine.types import Span

_key = locomo.LocomoBench._key
_layout = InferScaleEngine._layout


def key(self, conv, q, mode, w, k):
    return _key(self, conv, q, "inject+last" if mode == "inject" else mode, w, k)


def layout(self, segments):
    spans = [i for i, s in enumerate(segments) if isinstance(s, Span)]
    if spans:
        last = spans[-1]
        segments = [*segments[:last], list(segments[last].token_ids), *segments[last + 1 :]]
    return _layout(self, segments)


if __name__ == "__main__":
    locomo.LocomoBench._key = key
    InferScaleEngine._layout = layout
    sys.exit(main(sys.argv[1:]))

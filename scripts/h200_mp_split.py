"""Where a k=50 request's time goes, multiprocess against in-process (diagnostic): per request
the owner's preparation (plan, staging), the way to vLLM's scheduler (``queued_ts``), the wait
to be scheduled, the engine step that computes the first token (connector included), and the
way back to the caller, from vLLM's own request timestamps (``disable_log_stats=False``; engine
core timestamps are ``time.monotonic()``, comparable across processes of one host). The floor
(the same prompt already in vLLM's prefix cache) against KV injection, every pool fact served
once first.

usage: python3 scripts/h200_mp_split.py MODEL_DIR [MODES]   (MODES: multiprocess,inprocess)
"""

import statistics
import sys
import time

from inferscale_apps.bench.common import SyntheticWorkload
from inferscale_engine.engine import InferScaleEngine
from inferscale_engine.testing import prepared

PARTS = ("prepare", "to_queue", "to_schedule", "step", "back", "total")


def timed(engine: InferScaleEngine, segments: list, mode: str) -> dict[str, float]:
    t0 = time.monotonic()
    with prepared(engine, segments, "default", max_tokens=1, mode=mode) as request:
        t1 = time.monotonic()
        for out, _ in engine.loop.iterate(request.prompt, request.params, request.started):
            t_back = time.monotonic()
            m = out.metrics
            if out.finished:
                break
    return {"prepare": t1 - t0, "to_queue": m.queued_ts - t1, "to_schedule": m.scheduled_ts - m.queued_ts,
            "step": m.first_token_ts - m.scheduled_ts, "back": t_back - m.first_token_ts, "total": t_back - t0}


if __name__ == "__main__":
    model = sys.argv[1]
    for mode in (sys.argv[2] if len(sys.argv) > 2 else "multiprocess,inprocess").split(","):
        with InferScaleEngine(model=model, device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                              max_model_len=16384, recompute=0, multiprocess=mode == "multiprocess",
                              disable_log_stats=False) as engine:
            work = SyntheticWorkload.build(engine, pool=100, fact_tokens=28, head_tokens=64, question_tokens=24)
            for first in range(0, 100, 50):
                engine.generate_segments(work.inject_segments(list(range(first, first + 50)), work.question()),
                                         max_tokens=1, mode="inject")
            rows: dict[str, list[dict[str, float]]] = {"floor": [], "inject": []}
            for rep in range(43):
                picks = work.sample(50)
                engine.generate_segments(work.prompt_segments(picks, work.question()), max_tokens=1, mode="prompt")
                engine.generate_segments([work.head + work.question()], max_tokens=1, mode="prompt")
                for name in ("inject", "floor") if rep % 2 == 0 else ("floor", "inject"):
                    segments = (work.inject_segments if name == "inject" else work.prompt_segments)(picks, work.question())
                    sample = timed(engine, segments, "inject" if name == "inject" else "prompt")
                    if rep >= 3:
                        rows[name].append(sample)
            for name, samples in rows.items():
                print(mode, name, " ".join(f"{p} {1e3 * statistics.median(s[p] for s in samples):.3f}" for p in PARTS),
                      flush=True)

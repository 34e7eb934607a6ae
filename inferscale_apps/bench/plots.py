"""PNG plots of benchmark rows (matplotlib, headless): one per benchmark, :func:`plot` picks it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Rows = list[dict[str, Any]]


@contextlib.contextmanager
def _figure(path: str, title: str, ncols: int = 1) -> Iterator[Any]:
    """Axes to draw on; the figure is titled, laid out and saved to ``path`` on the way out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 4.5), squeeze=False)
    try:
        yield axes[0] if ncols > 1 else axes[0][0]
        fig.suptitle(title)
        for ax in axes[0]:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_ttft(rows: Rows, path: str, *, title: str) -> None:
    """TTFT p50 vs k, a line per mode; no memory as a reference line."""
    with _figure(path, title) as ax:
        styles = {"prompt": "o-", "inject": "s-", "floor": "^--", "none": "x:"}
        for mode, style in styles.items():
            pts = sorted((r["k"], r["ttft_ms_p50"]) for r in rows if r["mode"] == mode)
            if mode == "none" and pts:  # one point at k=0: draw it as a reference line
                ax.axhline(pts[0][1], linestyle=":", color="grey", label="no memory (k=0)")
            elif pts:
                ax.plot(*zip(*pts), style, label={"prompt": "prompt injection", "inject": "KV injection",
                                                  "floor": "prefix-cache floor"}[mode])
        ax.set_xlabel("retrieved facts k")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.legend()


def plot_throughput(rows: Rows, path: str, *, title: str) -> None:
    """Requests/s and TTFT (p50, p95 dashed) vs concurrent users, a line per mode."""
    with _figure(path, title, ncols=2) as (rate, ttft):
        labels = {"prompt": "prompt injection", "inject": "KV injection", "floor": "prefix-cache floor"}
        for i, (mode, label) in enumerate(labels.items()):
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["users"])
            if not mine:
                continue
            users = [r["users"] for r in mine]
            rate.plot(users, [r["req_per_s"] for r in mine], "o-", color=f"C{i}", label=label)
            ttft.plot(users, [r["ttft_ms_p50"] for r in mine], "o-", color=f"C{i}", label=f"{label}, p50")
            ttft.plot(users, [r["ttft_ms_p95"] for r in mine], "--", color=f"C{i}", alpha=0.6, label=f"{label}, p95")
        rate.set_xlabel("concurrent users")
        rate.set_ylabel("requests / s")
        rate.legend()
        ttft.set_xlabel("concurrent users")
        ttft.set_ylabel("TTFT (ms)")
        ttft.set_yscale("log")
        ttft.legend(fontsize=8)


def plot_tiers(rows: Rows, path: str, *, title: str) -> None:
    """TTFT p50 per tier and k, split into the promotion and the request that follows it."""
    with _figure(path, title) as ax:
        ks = sorted({r["k"] for r in rows})
        tiers = list(dict.fromkeys(r["tier"] for r in rows))
        width = 0.8 / max(len(ks), 1)
        for i, k in enumerate(ks):
            by = {r["tier"]: r for r in rows if r["k"] == k}
            x = [j + (i - (len(ks) - 1) / 2) * width for j in range(len(tiers))]
            promote = [by[t]["promote_ms_p50"] if t in by else 0.0 for t in tiers]
            rest = [by[t]["ttft_ms_p50"] - p if t in by else 0.0 for t, p in zip(tiers, promote)]
            ax.bar(x, promote, width, color=f"C{i}", alpha=0.5, label=f"k={k}: promotion")
            ax.bar(x, rest, width, bottom=promote, color=f"C{i}", label=f"k={k}: request")
        ax.set_xticks(range(len(tiers)), tiers)
        ax.set_ylabel("TTFT p50 (ms)")
        ax.legend(fontsize=8)


def plot_exactness(rows: Rows, path: str, *, title: str) -> None:
    """Largest logprob difference to prompt injection, per mode (log scale), each bar labelled
    with its value and whether the greedy tokens matched."""
    with _figure(path, title) as ax:
        modes = [r["mode"] for r in rows]
        # A difference of exactly 0 has no place on a log axis: drawn at the float32 epsilon,
        # labelled with its true value.
        diffs = [max(float(r["max_logit_diff"]), 1.2e-7) for r in rows]
        bars = ax.bar(modes, diffs, color=["C2" if r["greedy_match"] else "C3" for r in rows])
        for bar, r in zip(bars, rows):
            verdict = "greedy match" if r["greedy_match"] else f"diverges at token {r['first_divergence']}"
            ax.annotate(f"{r['max_logit_diff']:.2g}, {verdict}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_yscale("log")
        ax.set_ylabel("max |logprob difference| vs prompt injection")


def plot_locomo(rows: Rows, path: str, *, title: str) -> None:
    """F1 per k: inject against w as lines (one style per recompute value, when several), prompt
    as dashed references, full as a dotted one."""
    with _figure(path, title) as ax:
        ks = sorted({r["k"] for r in rows if r["k"] is not None})
        rs = sorted({r.get("recompute", 0) for r in rows if r["mode"] == "inject"})
        styles = ["o-", "s--", "^-.", "d:", "v-", "x--"]
        for i, k in enumerate(ks):
            color = f"C{i}"
            for j, rc in enumerate(rs):
                pts = sorted((r["w"], r["f1"]) for r in rows if r["mode"] == "inject" and r["k"] == k
                             and r.get("recompute", 0) == rc and r["f1"] is not None)
                if pts:
                    label = f"KV injection, k={k}" + (f", recompute={rc}" if len(rs) > 1 else "")
                    ax.plot(*zip(*pts), styles[j % len(styles)], color=color, label=label)
            prompt = [r["f1"] for r in rows if r["mode"] == "prompt" and r["k"] == k and r["f1"] is not None
                      and r.get("order", "conversation") == "conversation"]
            if prompt:
                ax.axhline(prompt[0], linestyle="--", color=color, alpha=0.7, label=f"prompt (pasted), k={k}")
        full = [r["f1"] for r in rows if r["mode"] == "full" and r["f1"] is not None]
        if full:
            ax.axhline(full[0], linestyle=":", color="grey", label="full conversation")
        ax.set_xlabel("context window w (turns)")
        ax.set_ylabel("LoCoMo token F1 (cat. 1-4)")
        ax.legend(fontsize=7)


PLOTS: dict[str, Callable[..., None]] = {
    "ttft": plot_ttft,
    "throughput": plot_throughput,
    "tiers": plot_tiers,
    "exactness": plot_exactness,
    "locomo": plot_locomo,
}


def plot(bench: str, rows: Rows, path: str, *, title: str) -> None:
    """Write benchmark ``bench``'s plot of ``rows`` to ``path`` (PNG)."""
    PLOTS[bench](rows, path, title=title)


def main(argv: list[str] | None = None) -> None:
    """``python -m inferscale_apps.bench.plots RESULT.json OUT.png``: the plot of a ``--json`` file."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m inferscale_apps.bench.plots", description=main.__doc__)
    parser.add_argument("json", help="a file `inferscale bench ... --json` wrote")
    parser.add_argument("png")
    parser.add_argument("--title", help="default: the benchmark, GPU and model recorded in the file")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    env = data.get("env", {})
    title = args.title or f"{data['bench']} — {env.get('gpu') or 'CPU'}, {env.get('model', '')}"
    plot(data["bench"], data["results"], args.png, title=title)


if __name__ == "__main__":
    main()

"""PNG plots of benchmark rows (matplotlib, headless)."""

from __future__ import annotations

from typing import Any


def plot_ttft(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

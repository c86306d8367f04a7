"""`specd bench sweep`'s plots, throughput and TPOT p99 against concurrency per mode, the
peers measured in the same run beside specd on the throughput plot (matplotlib is
optional: without it the JSON and the markdown are the results)."""

from __future__ import annotations

from pathlib import Path

PLOTS = (("tokens_per_s", "Throughput", "tokens/s"), ("tpot_p99", "TPOT p99", "seconds"))


def lines(report: dict, key: str) -> dict[str, tuple[list[int], list[float], bool]]:
    """One plot's lines, label -> (concurrency levels, values, a peer's): each specd mode's,
    then on the throughput plot each peer's: a llama-server set-up at every level it ran
    (one that did not start holds its error instead), transformers' generate at 1."""
    out = {}
    for mode in dict.fromkeys(c["mode"] for c in report["cells"]):
        cells = [c for c in report["cells"] if c["mode"] == mode and c[key] is not None]
        out[f"specd {mode}"] = ([c["concurrency"] for c in cells], [c[key] for c in cells], False)
    if key != "tokens_per_s":  # the peers' runs record tokens and time, no per-token times
        return out
    for name, cells in report.get("llamacpp", {}).items():
        if isinstance(cells, list):
            levels, rates = [c["concurrency"] for c in cells], [c["tokens_per_s"] for c in cells]
            out[f"llama-server {name}"] = (levels, rates, True)
    for name, result in report.get("peer", {}).items():
        out[name] = ([1], [result["tok_per_s"]], True)
    return out


def plot(report: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # an optional extra: the JSON and markdown are the results
        print("plots skipped: matplotlib is missing (pip install 'specd[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title, unit in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, (levels, values, peer) in lines(report, key).items():
            style = dict(linestyle="--", marker="s") if peer else dict(marker="o")
            ax.plot(levels, values, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(f"{title} vs concurrency")
        ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"sweep_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths

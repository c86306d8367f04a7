"""`specd bench sweep`'s plots, throughput and TPOT p99 against concurrency per mode
(matplotlib is optional: without it the JSON and the markdown are the results)."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # an optional extra: the JSON and markdown are the results
        print("plots skipped: matplotlib is missing (pip install 'specd[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title, unit in (
        ("tokens_per_s", "Throughput", "tokens/s"),
        ("tpot_p99", "TPOT p99", "seconds"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in dict.fromkeys(c["mode"] for c in report["cells"]):
            cells = [c for c in report["cells"] if c["mode"] == mode and c[key] is not None]
            ax.plot(
                [c["concurrency"] for c in cells], [c[key] for c in cells], marker="o", label=mode
            )
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

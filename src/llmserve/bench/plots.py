"""PNG plots of a run, one line per server: throughput and TTFT across load levels, latency CDFs per level."""

from __future__ import annotations

import os

import numpy as np

from llmserve.bench.metrics import MS_PER_S, Stats
from llmserve.bench.runner import BenchResult, LevelRun


def write_plots(result: BenchResult, out_dir: str) -> list[str]:
    """Write the plots that have data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        _level_plot(result, out_dir, "throughput.png", "Output throughput", "output tokens/s",
                    lambda run: {"": run.metrics.output_throughput}),
        _level_plot(result, out_dir, "ttft_vs_load.png", "TTFT", "TTFT (ms)", _ttft_points),
        _cdf_plot(result, out_dir, "ttft_cdf.png", "TTFT", lambda run: [r.ttft_s for r in _ok(run) if r.ttft_s is not None]),
        _cdf_plot(result, out_dir, "itl_cdf.png", "ITL", lambda run: [g for r in _ok(run) for g in r.itl_s]),
        _cdf_plot(result, out_dir, "e2e_cdf.png", "E2E latency", lambda run: [r.e2e_s for r in _ok(run) if r.e2e_s is not None]),
    ]
    return [p for p in paths if p is not None]


def _ok(run: LevelRun):
    return (r for r in run.records if r.is_success)


def _ttft_points(run: LevelRun) -> dict[str, float]:
    stats: Stats | None = run.metrics.ttft_ms
    return {} if stats is None else {"median": stats.median, "p99": stats.p99}


def _x_label(result: BenchResult) -> str:
    return "request rate (req/s)" if result.levels[0].is_open_loop else "concurrency"


def _level_plot(result: BenchResult, out_dir: str, name: str, title: str, y_label: str, points) -> str | None:
    """One line per server and series ({series: value} of `points(run)`), over the levels as categories."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.arange(len(result.levels))
    has_data = False
    for i, server in enumerate(result.servers):
        per_level = [points(result.run(server.label, lv)) for lv in result.levels]
        for k, series in enumerate(dict.fromkeys(key for values in per_level for key in values)):
            ys = [values.get(series, np.nan) for values in per_level]
            ax.plot(x, ys, "-" if k == 0 else "--", marker="o", color=f"C{i}", label=f"{server.label} {series}".strip())
            has_data = True
    return _finish(fig, ax, out_dir, name, title, y_label, result, x) if has_data else _discard(fig)


def _finish(fig, ax, out_dir: str, name: str, title: str, y_label: str, result: BenchResult, x) -> str:
    import matplotlib.pyplot as plt

    ax.set_xticks(x, [_tick(lv.name) for lv in result.levels])
    ax.set_xlabel(_x_label(result))
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tick(level_name: str) -> str:
    return level_name.split("=", 1)[1] if level_name.count("=") == 1 else level_name


def _discard(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
    return None


def _cdf_plot(result: BenchResult, out_dir: str, name: str, what: str, values_s) -> str | None:
    """One panel per level, one CDF line per server."""
    import matplotlib.pyplot as plt

    num = len(result.levels)
    cols = min(num, 4)
    rows = (num + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False)
    has_data = False
    for ax, level in zip(axes.flat, result.levels):
        for i, server in enumerate(result.servers):
            ms = np.sort(np.asarray(values_s(result.run(server.label, level)), dtype=np.float64)) * MS_PER_S
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), color=f"C{i}", drawstyle="steps-post", label=server.label)
                has_data = True
        ax.set_title(level.name)
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests" if what != "ITL" else "fraction of chunks")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    for ax in list(axes.flat)[num:]:
        ax.set_visible(False)
    if not has_data:
        return _discard(fig)
    fig.suptitle(f"{what} CDF")
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

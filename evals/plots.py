"""The eval's plots: perplexity against decode speed (the Pareto picture), and the models on the roofline.

Drawn like :mod:`qinfer.evals.roofline_plot`: a bare ``Figure`` on the Agg canvas (no pyplot state), and
point labels placed by its ``_place`` so that they overlap neither each other nor the markers.
"""

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from qinfer.evals.roofline import Roofline, RooflinePoint
from qinfer.evals.roofline_plot import _OFFSETS, _place, plot_roofline

_MIB = 1 << 20


def short_labels(results) -> list[str]:
    """Labels for crowded plots: "gemma3-270m-rtn-w4g128" becomes "rtn-w4g128" beside a "gemma3-270m" baseline."""
    bases = [r.label for r in results if r.is_baseline]
    out = []
    for r in results:
        prefix = next((f"{b}-" for b in bases if r.label.startswith(f"{b}-") and len(r.label) > len(b) + 1), "")
        out.append(r.label.removeprefix(prefix))
    return out


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes, for (x higher is better, y lower is better)."""
    front, best_y = [], float("inf")
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if y < best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def plot_pareto(results, text_description: str, path: Path) -> Path:
    """Perplexity vs decode tokens/s, one labelled point per model (vs size on disk without speed)."""
    with_speed = all(r.speed is not None for r in results)
    if with_speed:
        xs = [r.speed.decode_tok_s for r in results]
        xlabel, better = "decode speed at batch 1 (tokens/s, median of runs)", "faster"
    else:  # smaller is better on this axis: negate for the front, plot as is
        xs = [r.size_bytes / _MIB for r in results]
        xlabel, better = "size on disk (MiB; speed not measured)", "smaller"
    ys = [r.text.ppl for r in results]
    # A model whose perplexity (or speed) is NaN or infinite (NaN weights, say) has no place on the axes: named below.
    finite = [math.isfinite(x) and math.isfinite(y) for x, y in zip(xs, ys)]
    left_out = [label for label, ok in zip(short_labels(results), finite) if not ok]
    results = [r for r, ok in zip(results, finite) if ok]
    xs, ys = [x for x, ok in zip(xs, finite) if ok], [y for y, ok in zip(ys, finite) if ok]
    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel(xlabel)
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"accuracy vs {'speed' if with_speed else 'size'}: perplexity on {text_description}\n"
                 "(labels: KL(baseline ‖ model), nats per token)", fontsize=10)
    ax.grid(True, alpha=0.3)
    if left_out:
        ax.text(0.01, 0.01, f"not plotted (perplexity not finite): {', '.join(left_out)}", transform=ax.transAxes,
                fontsize=8, color="tab:red")
    if not results:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
        return path
    sign = 1 if with_speed else -1
    front = [(sign * x, y) for x, y in pareto_front([(sign * x, y) for x, y in zip(xs, ys)])]
    if len(front) > 1:
        fx, fy = zip(*sorted(front))
        ax.plot(fx, fy, linestyle="--", color="gray", linewidth=1, zorder=1,
                label=f"Pareto front ({better} and lower perplexity)")
    for r, x, y in zip(results, xs, ys):
        ax.scatter([x], [y], marker="*" if r.is_baseline else "o", s=140 if r.is_baseline else 60, zorder=3,
                   color="tab:red" if r.is_baseline else "tab:blue", edgecolors="black", linewidths=0.5)
    _pad_limits(ax, xs, ys)
    if len(front) > 1:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    placed = [Bbox([[cx - 7, cy - 7], [cx + 7, cy + 7]]) for cx, cy in ax.transData.transform(list(zip(xs, ys)))]
    if ax.get_legend() is not None:
        placed.append(ax.get_legend().get_window_extent(renderer))
    axes_box = ax.get_window_extent(renderer)
    for r, label, x, y in sorted(zip(results, short_labels(results), xs, ys), key=lambda t: (t[2], t[3])):
        name = f"{label} (baseline)" if r.is_baseline else label
        text = ax.annotate(f"{name}\nKL {r.text.kl:.3f}", (x, y), xytext=(0, 0), textcoords="offset points",
                           fontsize=8)
        candidates = [((x, y), offset, "left" if offset[0] > 0 else "right") for offset in _OFFSETS]
        placed.append(_place(text, candidates, placed, axes_box, renderer))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _pad_limits(ax, xs, ys) -> None:
    """Room around the points for their labels (labels left of a point need room at the left edge too)."""
    for values, setter in ((xs, ax.set_xlim), (ys, ax.set_ylim)):
        lo, hi = min(values), max(values)
        span = (hi - lo) or abs(hi) or 1.0
        low = lo - 0.35 * span
        setter(max(low, 0.0) if lo >= 0 else low, hi + 0.35 * span)  # speeds and sizes are never negative


def roofline_points(results) -> list[RooflinePoint]:
    """Each model's decode step (eager, and compiled when timed) and prefill: FLOP per byte moved, and achieved
    TFLOP/s."""
    points = []
    for r, label in zip(results, short_labels(results)):
        s = r.speed
        if s is None:
            continue
        points.append(RooflinePoint(label, s.decode_flops / s.decode_bytes, s.decode_flops / s.tpot_s / 1e12, "decode"))
        if s.compiled_tpot_s is not None:
            points.append(RooflinePoint(label, s.decode_flops / s.decode_bytes, s.decode_flops / s.compiled_tpot_s / 1e12,
                                        "compiled decode"))
        points.append(RooflinePoint(label, s.prefill_flops / s.prefill_bytes, s.prefill_flops / s.ttft_s / 1e12,
                                    "prefill"))
    return points


def plot_models_roofline(results, roofline: Roofline, path: Path) -> Path:
    return plot_roofline(roofline, roofline_points(results), path)

"""The roofline picture: log-log axes, the bandwidth slope, one ceiling per dtype, measured points.

Kept apart from :mod:`qinfer.evals.roofline` so that measuring never imports matplotlib. We draw on a
bare ``Figure`` with the Agg canvas instead of going through ``pyplot``: no global backend switch, no
figure registry to leak into, safe in a server or a test process.

Labels must stay readable with many points, so each ceiling and point label tries a few positions and
takes the first whose box stays inside the axes and overlaps nothing placed before it: the roof lines,
the markers, the labels already placed.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from qinfer.evals.roofline import Roofline, RooflinePoint, attainable_tflops, threads_text

_DTYPE_STYLE = {"bf16": ("tab:blue", "-"), "fp32": ("tab:orange", "--")}
_KIND_STYLE = {"decode": ("o", "tab:green"), "compiled decode": ("D", "tab:olive"), "prefill": ("s", "tab:purple")}
# offsets (points) of a point label from its marker, tried in order: beside it, then farther away (those
# get a leader line, see _FAR)
_OFFSETS = [(7, 5), (7, -12), (8, -3), (-7, 5), (-7, -12), (-8, -3),
            (7, 18), (7, -26), (-7, 18), (-7, -26), (14, 32), (14, -40), (-14, 32), (-14, -40)]
_FAR = 14


def plot_roofline(roofline: Roofline, points: Sequence[RooflinePoint], path: Path) -> Path:
    """Draw the roof and ``points`` on log-log axes into the PNG ``path``; returns ``path``."""
    path = Path(path)
    bw_tflops_per_ai = roofline.bandwidth_gbs * 1e9 / 1e12  # TFLOP/s per FLOP/byte on the slope
    ridges = [roofline.ridge(d) for d in roofline.peak_tflops]
    ais = [p.arithmetic_intensity for p in points]
    x_lo = 10 ** np.floor(np.log10(min(ais + ridges) / 10))
    x_hi = 10 ** np.ceil(np.log10(max(ais + ridges) * 10))
    y_hi = 10 ** np.ceil(np.log10(max([*roofline.peak_tflops.values()] + [p.tflops for p in points]) * 3))
    y_lo = 10 ** np.floor(np.log10(min([x_lo * bw_tflops_per_ai] + [p.tflops for p in points])))

    fig = Figure(figsize=(9, 6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("performance (TFLOP/s)")
    ax.set_title(
        f"{roofline.cpu_name} ({roofline.device}, {threads_text(roofline.threads)}, torch {roofline.torch_version})\n"
        f"measured {roofline.timestamp}",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)

    xs = np.logspace(np.log10(x_lo), np.log10(x_hi), 400)
    for dtype in roofline.peak_tflops:
        color, style = _DTYPE_STYLE.get(dtype, ("tab:gray", ":"))
        roof = [attainable_tflops(x, roofline, dtype) for x in xs]
        ax.plot(xs, roof, color=color, linestyle=style, linewidth=2, zorder=2)
    for kind in _KIND_STYLE:
        group = [p for p in points if p.kind == kind]
        if group:
            marker, color = _KIND_STYLE[kind]
            ax.scatter([p.arithmetic_intensity for p in group], [p.tflops for p in group],
                       marker=marker, color=color, s=45, zorder=3, label=kind, edgecolors="black", linewidths=0.5)
    legend = ax.legend(loc="upper left", title="measured", fontsize=9, title_fontsize=9) if points else None
    # Layout first, then place labels: display coordinates are final from here on (savefig keeps them).
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes_box = ax.get_window_extent(renderer)
    # display-space boxes a label must not cover: the roof lines (sampled as small boxes) and the markers
    placed = [legend.get_window_extent(renderer)] if legend is not None else []
    for line in ax.get_lines():
        for cx, cy in line.get_transform().transform(line.get_xydata()[::4]):
            placed.append(Bbox([[cx - 2, cy - 2], [cx + 2, cy + 2]]))
    for p in points:
        cx, cy = ax.transData.transform((p.arithmetic_intensity, p.tflops))
        placed.append(Bbox([[cx - 6, cy - 6], [cx + 6, cy + 6]]))

    # The slope label, rotated along the slope near its low end, where no point is: points sit under the
    # roof, and this spot is at least 5x left of every point and ridge.
    x_text = x_lo * 2
    (x0, y0), (x1, y1) = ax.transData.transform(
        [(x_text, x_text * bw_tflops_per_ai), (x_text * 10, x_text * 10 * bw_tflops_per_ai)]
    )
    angle = float(np.degrees(np.arctan2(y1 - y0, x1 - x0)))
    text = ax.annotate(
        f"memory read {roofline.bandwidth_gbs:.1f} GB/s",
        (x_text, x_text * bw_tflops_per_ai), xytext=(0, 6), textcoords="offset points",
        rotation=angle, rotation_mode="anchor", fontsize=9,
    )
    placed.append(text.get_window_extent(renderer))

    # Ceiling labels: at the right end, mid-way or just right of the ridge; above the line, else below.
    for dtype, peak in sorted(roofline.peak_tflops.items(), key=lambda kv: -kv[1]):
        color, _ = _DTYPE_STYLE.get(dtype, ("tab:gray", ":"))
        text = ax.annotate(f"{dtype} peak {peak:.3g} TFLOP/s", (x_hi, peak), xytext=(0, 0),
                           textcoords="offset points", fontsize=9, color=color)
        ridge = roofline.ridge(dtype)
        anchors = [((x_hi, peak), -6, "right"), (((ridge * x_hi) ** 0.5, peak), 0, "center"),
                   ((ridge * 1.3, peak), 0, "left")]
        candidates = [(xy, (dx, dy), ha) for xy, dx, ha in anchors for dy in (5, -13)]
        placed.append(_place(text, candidates, placed, axes_box, renderer))

    # a compiled decode point sits straight above its model's eager one (the same bytes and FLOPs): the marker
    # alone, so a plot of several models is not twice as crowded with names
    named = [p for p in points if p.kind != "compiled decode"]
    for p in sorted(named, key=lambda p: (p.arithmetic_intensity, p.tflops)):
        xy = (p.arithmetic_intensity, p.tflops)
        text = ax.annotate(p.name, xy, xytext=(0, 0), textcoords="offset points", fontsize=8)
        candidates = [(xy, offset, "left" if offset[0] > 0 else "right") for offset in _OFFSETS]
        placed.append(_place(text, candidates, placed, axes_box, renderer))
        if abs(text.xyann[1]) > _FAR:
            ax.annotate("", xy, xytext=text.xyann, textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "color": "gray", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 4})
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _place(text, candidates, placed: list, axes_box, renderer):
    """Move ``text`` to the first ``(xy, offset, ha)`` whose box is inside the axes and overlaps nothing
    in ``placed``; if every candidate collides (a very crowded plot) keep the first. Returns its box."""
    for xy, offset, ha in candidates + candidates[:1]:
        text.xy = xy
        text.set_position(offset)
        text.set_ha(ha)
        box = text.get_window_extent(renderer)
        inside = axes_box.x0 <= box.x0 and box.x1 <= axes_box.x1 and axes_box.y0 <= box.y0 and box.y1 <= axes_box.y1
        if inside and not any(box.overlaps(other) for other in placed):
            return box
    return box

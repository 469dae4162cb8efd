from types import SimpleNamespace

from qinfer.evals.plots import pareto_front, plot_pareto, short_labels


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    # (tokens/s higher is better, perplexity lower is better)
    points = [(10.0, 33.0), (3.6, 56.8), (3.2, 38.9), (12.0, 40.0), (12.0, 45.0), (1.8, 34.0), (1.0, 30.0)]
    assert pareto_front(points) == [(1.0, 30.0), (10.0, 33.0), (12.0, 40.0)]
    assert pareto_front([(1.0, 1.0)]) == [(1.0, 1.0)]


def test_short_labels_drop_the_baseline_name_from_its_derivatives():
    rows = [SimpleNamespace(label=label, is_baseline=label == "gemma3-270m")
            for label in ("gemma3-270m", "gemma3-270m-rtn-w4g128", "gemma3-270mx", "other")]
    assert short_labels(rows) == ["gemma3-270m", "rtn-w4g128", "gemma3-270mx", "other"]


def test_a_model_without_a_finite_perplexity_is_left_out_of_the_plot(tmp_path, monkeypatch):
    """NaN weights give a NaN perplexity: the plot leaves that model out and says so (axis limits cannot be NaN)."""
    from matplotlib.axes import Axes

    def row(label, ppl, size):
        return SimpleNamespace(label=label, is_baseline=label == "base", speed=None, size_bytes=size,
                               text=SimpleNamespace(ppl=ppl, kl=0.0))

    drawn, text = [], Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: drawn.append(s) or text(self, x, y, s, *a, **k))
    for rows, left_out in (([row("base", float("nan"), 2 << 20)], "base"),
                           ([row("base", 30.0, 2 << 20), row("broken", float("nan"), 1 << 20),
                             row("q", float("inf"), 1 << 19)], "broken, q")):
        drawn.clear()
        path = plot_pareto(rows, "a text", tmp_path / f"{len(rows)}.png")
        assert path.read_bytes()[:4] == b"\x89PNG"
        assert f"not plotted (perplexity not finite): {left_out}" in drawn

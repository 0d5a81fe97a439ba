"""A run's accuracy figure (``accuracy.png``), and the bare figure every plot of the library draws on: an Agg
`Figure` without pyplot's global state, so nothing to close and no backend switch."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def figure(width: float, height: float, layout: str | None = None):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(width, height), layout=layout)
  FigureCanvasAgg(fig)
  return fig


def _margins_in_inches(fig, panels: int) -> None:
  """Room for the tick labels, axis labels and titles, fixed: `tight_layout` measures every text by drawing the
  figure once more, which cost a third of a run's plot (the runs of the test suite draw hundreds)."""
  width, height = fig.get_size_inches()
  gap = 0.9  # (the right panel's own tick labels)
  fig.subplots_adjust(left=0.8 / width, right=1 - 0.2 / width, bottom=0.6 / height, top=1 - 0.4 / height,
                      wspace=gap / ((width - 1.0 - gap * (panels - 1)) / panels))


def plot_accuracy(rows: Sequence[Mapping[str, Any]], path: str, title: str) -> str:
  """A run's test accuracy vs round, one line per architecture group plus the mean (with per-client evaluation, each
  group's worst 10% of its clients' held-out accuracy dashed); beside it, if the rows log it, the gradient
  dissimilarity of the low and high parts per group (a run's ``accuracy.png``)."""
  evaluated = [r for r in rows if r.get("test_accuracy")]
  spread = [r for r in rows if any(part is not None for group in (r.get("dissimilarity") or {}).values()
                                   for part in (group.get("low"), group.get("high")))]
  fig = figure(12 if spread else 7, 4.5)
  ax, *right = fig.subplots(1, 2 if spread else 1, squeeze=False)[0]
  if spread:
    for group in spread[-1]["dissimilarity"]:
      for part, style in (("low", "--"), ("high", "-")):
        points = [(r["round"], r["dissimilarity"][group][part]) for r in spread
                  if r["dissimilarity"].get(group, {}).get(part) is not None]
        if points:
          right[0].plot(*zip(*points), style, lw=1.1, label=f"{group} {part}")
    right[0].set_yscale("log")
    right[0].set_xlabel("round")
    right[0].set_title("gradient dissimilarity Σ p_c ‖d_c − d̄‖² / ‖d̄‖²")
    right[0].grid(alpha=0.3)
    right[0].legend(fontsize="small")
  if evaluated:
    for index, name in enumerate(evaluated[-1]["test_accuracy"]):
      xs = [r["round"] for r in evaluated]
      ys = [100 * r["test_accuracy"][name] for r in evaluated]
      if name == "mean":
        ax.plot(xs, ys, "k-", lw=2.5, label="mean over groups")
        continue
      ax.plot(xs, ys, "-", lw=1.3, marker=".", label=name, color=f"C{index % 10}")
      clients = [(r["round"], 100 * r["client_accuracy"][name]["worst_10pct"]) for r in evaluated
                 if r.get("client_accuracy")]  # (per-client evaluation: the worst 10% of the group's clients)
      if clients:
        ax.plot(*zip(*clients), "--", lw=1.1, label=f"{name}: worst 10% of its clients", color=f"C{index % 10}")
  ax.set_xlabel("round")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # (a run stopped before its first evaluation has no line)
    ax.legend(loc="lower right", fontsize="small" if any(r.get("client_accuracy") for r in evaluated) else None)
  _margins_in_inches(fig, panels=2 if spread else 1)
  fig.savefig(path, dpi=120)
  return path

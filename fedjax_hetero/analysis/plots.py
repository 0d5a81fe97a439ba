"""Analysis figures: InCo update histograms and cross-layer tracking, FedCross client bubbles and similarity, runs'
accuracy per round (`compare --output`, with their clients' held-out accuracy), against their cumulative bytes
and FLOPs, and paired against a baseline's (`compare --paired-output`) (a run's own accuracy curves:
`fedjax_hetero.run.plot`).

All functions draw on a bare Agg `Figure` (no pyplot global state, so nothing
to close and no backend switch), save a PNG and return its path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from fedjax_hetero.run.plot import figure as _figure

if TYPE_CHECKING:
  from fedjax_hetero.analysis.runs import Pairing


def plot_update_histograms(deltas_by_round: Mapping[int, Mapping[str, np.ndarray]], path: str, bins: int = 60,
                           quantile: float = 0.001, density: bool = True, columns: int = 3,
                           title: str | None = None) -> str:
  """Per-layer histograms of update values over rounds (InCo paper Figs. 2c-d, 3); returns `path`.

  One panel per layer (in first-seen order); each round is a step histogram
  coloured by round on a shared colour scale. A layer's bins are shared by all
  rounds and span the [quantile, 1 - quantile] range of its values over all
  rounds, so a few outliers do not squash the shape.
  """
  if not deltas_by_round:
    raise ValueError("no rounds to plot")
  rounds = sorted(deltas_by_round)
  layers: list[str] = []
  for r in rounds:
    layers.extend(name for name in deltas_by_round[r] if name not in layers)
  if not layers:
    raise ValueError("no layers to plot")
  columns = max(1, min(columns, len(layers)))
  rows = math.ceil(len(layers) / columns)
  fig = _figure(4.2 * columns + 1.0, 3.0 * rows + 0.4, layout="constrained")
  axes = fig.subplots(rows, columns, squeeze=False).ravel()

  from matplotlib import cm, colormaps, colors
  norm = colors.Normalize(vmin=rounds[0], vmax=max(rounds[-1], rounds[0] + 1))
  cmap = colormaps["viridis"]
  for ax, layer in zip(axes, layers):
    values = {r: np.asarray(deltas_by_round[r][layer], np.float64).ravel()
              for r in rounds if layer in deltas_by_round[r]}
    pooled = np.concatenate(list(values.values()))
    pooled = pooled[np.isfinite(pooled)]
    low, high = np.quantile(pooled, [quantile, 1.0 - quantile]) if pooled.size else (-1.0, 1.0)
    if not high > low:
      low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    for r, v in values.items():
      counts, _ = np.histogram(v[np.isfinite(v)], bins=edges, density=density)
      ax.stairs(counts, edges, color=cmap(norm(r)), linewidth=1.0, alpha=0.85)
    ax.set_title(layer, fontsize=9)
    ax.set_xlabel("update value", fontsize=8)
    ax.set_ylabel("density" if density else "count", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
  for ax in axes[len(layers):]:
    ax.set_visible(False)
  mappable = cm.ScalarMappable(norm=norm, cmap=cmap)
  fig.colorbar(mappable, ax=list(axes[:len(layers)]), shrink=0.8, label="round")
  if title:
    fig.suptitle(title)
  fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
  return path


def plot_client_bubbles(counts: np.ndarray | Mapping[str, np.ndarray], path: str,
                        clients: Sequence[int] | None = None, max_area: float = 400.0,
                        title: str | None = None) -> str:
  """Client x class bubble plot, area proportional to the sample count (FedCross paper Fig. 3); returns `path`.

  `counts` is a [clients, classes] matrix, or a mapping panel title -> matrix
  (e.g. one panel per Dirichlet beta) drawn side by side on one size scale.
  `clients` selects and orders the clients shown (e.g. 10 random ones); the x
  ticks are their ids.
  """
  panels = dict(counts) if isinstance(counts, Mapping) else {"": counts}
  if not panels:
    raise ValueError("no count matrices to plot")
  selected = {}
  for name, matrix in panels.items():
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
      raise ValueError(f"counts must be [num_clients, num_classes], got shape {matrix.shape}")
    ids = np.arange(matrix.shape[0]) if clients is None else np.asarray(clients, np.int64)
    selected[name] = (ids, matrix[ids])
  largest = max(max(int(m.max(initial=0)) for _, m in selected.values()), 1)

  num_shown = max(ids.size for ids, _ in selected.values())
  num_classes = max(m.shape[1] for _, m in selected.values())
  panel_w = min(max(3.5, 0.32 * num_shown + 1.5), 20.0)
  panel_h = min(max(3.0, 0.32 * num_classes + 1.5), 14.0)
  fig = _figure(panel_w * len(selected), panel_h + 0.5)
  axes = fig.subplots(1, len(selected), squeeze=False)[0]
  for ax, (name, (ids, matrix)) in zip(axes, selected.items()):
    xs, ys = np.nonzero(matrix)
    ax.scatter(xs, ys, s=max_area * matrix[xs, ys] / largest, alpha=0.6, edgecolors="k", linewidths=0.3)
    ax.set_xlim(-0.7, len(ids) - 0.3)
    ax.set_ylim(-0.7, matrix.shape[1] - 0.3)
    step = max(1, len(ids) // 20)
    ax.set_xticks(np.arange(0, len(ids), step), [str(i) for i in ids[::step]], fontsize=7)
    ax.set_yticks(np.arange(matrix.shape[1]))
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("client id")
    ax.set_ylabel("class")
    ax.grid(True, linewidth=0.3, alpha=0.5)
    if name:
      ax.set_title(name)
  # Size key: a few reference counts on the shared scale.
  handles = [axes[0].scatter([], [], s=max_area * c / largest, color="C0", alpha=0.6, edgecolors="k",
                             linewidths=0.3, label=str(c))
             for c in sorted({max(1, round(largest * f)) for f in (0.1, 0.5, 1.0)})]
  axes[-1].legend(handles=handles, title="samples", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  fontsize=7, title_fontsize=8, labelspacing=1.2, frameon=False)
  if title:
    fig.suptitle(title)
  fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
  return path


def _finite(value: Any) -> float:
  return float(value) if value is not None and math.isfinite(float(value)) else float("nan")


def plot_similarity_tracking(rows: Sequence[Mapping[str, Any]], path: str, title: str | None = None) -> str:
  """Mean pairwise cosine and L2 distance of the middleware models vs round (FedCross spec Sec. 5.4).

  `rows` are metrics.jsonl records; those without "middleware_similarity"
  are skipped. The distance is read from "mean_l2" or, as
  `middleware_similarity_stats` names it, "mean_l2_distance". Returns `path`.
  """
  rounds, cosines, distances = [], [], []
  for i, row in enumerate(rows):
    stats = row.get("middleware_similarity")
    if not stats:
      continue
    rounds.append(row.get("round", i + 1))
    cosines.append(_finite(stats.get("mean_cosine")))
    distances.append(_finite(stats.get("mean_l2", stats.get("mean_l2_distance"))))
  fig = _figure(10.0, 3.8)
  ax_cos, ax_l2 = fig.subplots(1, 2)
  for ax, ys, label in ((ax_cos, cosines, "mean pairwise cosine"), (ax_l2, distances, "mean pairwise L2 distance")):
    if rounds:
      ax.plot(rounds, ys, "-", marker="." if len(rounds) < 60 else None, lw=1.3)
    else:
      ax.text(0.5, 0.5, "no middleware_similarity rows", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  fig.suptitle(title or "Middleware-model similarity")
  fig.tight_layout()
  fig.savefig(path, format="png", dpi=100)
  return path


def _short_names(names: Sequence[str]) -> list[str]:
  """Display labels: the '/'-separated names without the components they all share at both ends."""
  parts = [name.split("/") for name in names]
  if len(parts) < 2:
    return list(names)
  lead = 0
  while all(len(p) > lead + 1 and p[lead] == parts[0][lead] for p in parts):
    lead += 1
  trail = 0
  while all(len(p) > lead + trail + 1 and p[-1 - trail] == parts[0][-1 - trail] for p in parts):
    trail += 1
  return ["/".join(p[lead:len(p) - trail]) for p in parts]


def plot_inco_tracking(rows: Sequence[Mapping[str, Any]], path: str, title: str | None = None) -> str:
  """InCo's per-target-layer theta and fraction of slices with b > 0 vs round (InCo paper Sec. 5.4).

  `rows` are metrics.jsonl records; those without "inco" are skipped. A
  layer's value is missing (a gap) in rounds where no sampled client owned
  it (None in the record). Returns `path`.
  """
  tracked = [(row.get("round", i + 1), row["inco"]) for i, row in enumerate(rows) if row.get("inco")]
  rounds = [r for r, _ in tracked]
  layers: list[str] = []
  for _, stats in tracked:
    layers.extend(name for name in stats if name not in layers)
  series = {key: {name: np.array([_finite(stats[name].get(key)) if name in stats else np.nan
                                  for _, stats in tracked]) for name in layers}
            for key in ("theta", "frac_b_positive")}

  from matplotlib import colormaps
  from matplotlib.ticker import MaxNLocator

  fig = _figure(11.0, 4.0, layout="constrained")
  ax_theta, ax_b = fig.subplots(1, 2)
  # Up to 10 layers: distinct default colours; more: a sequential map in layer order.
  colours = ([f"C{i}" for i in range(len(layers))] if len(layers) <= 10
             else [colormaps["viridis"](v) for v in np.linspace(0.0, 1.0, len(layers))])
  labels = _short_names(layers)
  for ax, key, label in ((ax_theta, "theta", r"$\theta$ (mean over covered slices)"),
                         (ax_b, "frac_b_positive", "fraction of slices with b > 0")):
    if rounds:
      for index, (name, short) in enumerate(zip(layers, labels)):
        ax.plot(rounds, series[key][name], "-", marker="." if len(rounds) < 60 else None, lw=1.1,
                color=colours[index], label=short)
    else:
      ax.text(0.5, 0.5, "no inco rows", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  ax_b.set_ylim(-0.03, 1.03)
  if layers:
    ax_b.legend(title="target layer", loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7,
                title_fontsize=8, frameon=False, ncol=1 if len(layers) <= 20 else 2)
  fig.suptitle(title or "InCo cross-layer step per target layer")
  fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
  return path


# The x axes of `plot_accuracy_against_costs`: the running total of a metrics row's costs, and its label.
COST_AXES = (("bytes", "bytes sent and received, cumulative (down + up)", "B"),
             ("client_flops", "client training FLOPs, cumulative", "FLOP"))


def plot_accuracy_against_costs(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], path: str,
                                title: str = "mean test accuracy", styles: Sequence[Mapping[str, Any]] | None = None
                                ) -> str:
  """Mean test accuracy against the cumulative bytes (left) and client training FLOPs (right) of every run
  (``(label, metrics.jsonl rows)``, `fedjax_hetero.rounds.costs`), one line each (``styles``: its plot keywords);
  returns `path`. ValueError if no run logged costs."""
  from matplotlib.ticker import EngFormatter

  from fedjax_hetero.analysis.runs import accuracy_by_cost

  if not any(accuracy_by_cost(rows, "bytes") for _, rows in runs):
    raise ValueError("none of the runs logged costs at an evaluated round (runs written before cost accounting "
                     "have none): rerun them to plot accuracy against bytes and FLOPs")
  fig = _figure(13.0, 4.5)
  axes = fig.subplots(1, len(COST_AXES))
  for ax, (key, label, unit) in zip(axes, COST_AXES):
    for index, (name, rows) in enumerate(runs):
      points = accuracy_by_cost(rows, key)
      if points:
        style = dict(styles[index]) if styles else {}
        ax.plot([x for x, _ in points], [100 * a for _, a in points], marker=".", lw=1.5, label=name, **style)
    ax.set_xlabel(label)
    ax.xaxis.set_major_formatter(EngFormatter(unit=unit))
    ax.set_ylabel("mean test accuracy (%)")
    ax.grid(alpha=0.3)
  axes[0].legend(loc="lower right")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def run_styles(runs: Sequence[tuple[str, Mapping[str, Any], Any]]) -> list[dict[str, Any]]:
  """One colour per method, one line style per run of it (e.g. per seed)."""
  from fedjax_hetero.analysis.runs import method_of

  methods = list(dict.fromkeys(method_of(summary) for _, summary, _ in runs))
  styles, seen = [], {}
  for _, summary, _ in runs:
    method = method_of(summary)
    repeat = seen[method] = seen.get(method, -1) + 1
    styles.append(dict(color=f"C{methods.index(method) % 10}", ls=("-", "--", ":", "-.")[repeat % 4]))
  return styles


def _client_lines(ax: Any, label: str, rows: Sequence[Mapping[str, Any]], group: str, style: Mapping[str, Any],
                  lw: float) -> None:
  """A run's per-client evaluation of ``group`` ("all": every client) per round: the clients' mean (in ``style``)
  and their worst 10% (dashed)."""
  from fedjax_hetero.analysis.runs import client_accuracy_per_round

  for key, name in (("mean", "mean"), ("worst_10pct", "worst 10%")):
    points = client_accuracy_per_round(rows, group, key)
    if points:
      ax.plot(*zip(*[(r, 100 * a) for r, a in points]), marker=".", lw=lw, label=f"{label} {name}",
              **{**style, **({"ls": "--"} if key != "mean" else {})})


def plot_accuracy_per_round(runs: Sequence[tuple[str, Any, Sequence[Mapping[str, Any]]]], path: str, title: str,
                            styles: Sequence[Mapping[str, Any]], groups: Sequence[str] = ()) -> str:
  """``compare``'s figure of runs (``(label, summary, metrics.jsonl rows)``): mean test accuracy per round; then,
  where runs log them, every client's held-out accuracy (the worst 10% of all clients, dashed, under their mean),
  one panel per architecture group of ``groups`` (its model's accuracy), and the gradient dissimilarity of the low
  and high parts (`fedjax_hetero.methods.dissimilarity`); one line per run (``styles``: its plot keywords), the
  panels in rows of three. Returns `path`."""
  from fedjax_hetero.analysis.runs import dissimilarity_per_round, evaluated

  parts = [p for p in ("low", "high") if any(p in g for _, _, rows in runs for r in rows
                                              for g in (r.get("dissimilarity") or {}).values())]
  clients = int(any(r.get("client_accuracy") for _, _, rows in runs for r in rows))
  panels = 1 + clients + len(groups) + len(parts)
  columns, rows_of_panels = min(panels, 3), math.ceil(panels / 3)
  fig = _figure(7 + 4.5 * (columns - 1), 4.5 * rows_of_panels)
  axes = fig.subplots(rows_of_panels, columns, squeeze=False).ravel()
  for ax in axes[panels:]:
    ax.set_visible(False)
  if clients:
    ax = axes[1]
    for (label, _, rows), style in zip(runs, styles):
      _client_lines(ax, label, rows, "all", style, lw=1.2)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("every client with its group's model")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
  for ax, part in zip([axes[0], *axes[1 + clients:]], ["mean", *groups]):
    for (label, _, rows), style in zip(runs, styles):
      points = evaluated(rows, part)
      ax.plot([r for r, _ in points], [100 * a for _, a in points], marker=".", lw=1.5, label=label, **style)
    ax.set_xlabel("round")
    ax.set_ylabel("mean test accuracy (%)" if part == "mean" else "test accuracy (%)")
    ax.set_title(title if part == "mean" else f"group {part}")
    ax.grid(alpha=0.3)
  axes[0].legend(loc="lower right")
  for part, ax in zip(parts, axes[1 + clients + len(groups):]):
    for (label, _, rows), style in zip(runs, styles):
      points = dissimilarity_per_round(rows, part)
      if points:
        ax.plot(*zip(*points), lw=1.2, label=label, **{"marker": "." if len(points) == 1 else None, **style})
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("Σ p_c ‖d_c − d̄‖² / ‖d̄‖²")
    ax.set_title(f"gradient dissimilarity, {part} part")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def plot_paired_differences(pairings: Sequence[Pairing], baseline: str, path: str) -> str:
  """Each method's accuracy minus ``baseline``'s per round (`analysis.runs.pairings`), a panel per method on one
  scale: a thin line per seed, the mean over the seeds bold (at the rounds every seed evaluated), the seeds' mean
  difference and its t interval (`seed_interval`) in the title. Returns `path`."""
  from fedjax_hetero.analysis.runs import seed_interval

  columns = min(len(pairings), 3)
  fig = _figure(1.5 + 4.5 * columns, 3.6 * math.ceil(len(pairings) / 3))
  axes = fig.subplots(math.ceil(len(pairings) / 3), columns, squeeze=False, sharey=True).ravel()
  for ax in axes[len(pairings):]:
    ax.set_visible(False)
  seeds = sorted({s for p in pairings for s in p.seeds})  # (a seed's colour is the same in every panel)
  for ax, pairing in zip(axes, pairings):
    for seed, rounds, diffs in zip(pairing.seeds, pairing.rounds, pairing.diffs):
      ax.plot(rounds, diffs, lw=0.8, alpha=0.45, color=f"C{seeds.index(seed) % 10}", label=f"seed {seed}")
    shared = sorted(set.intersection(*(set(r.tolist()) for r in pairing.rounds)))
    by_seed = [dict(zip(r.tolist(), d)) for r, d in zip(pairing.rounds, pairing.diffs)]
    ax.plot(shared, [np.mean([d[r] for d in by_seed]) for r in shared], color="k", lw=2, label="mean over seeds")
    ax.axhline(0, color="grey", lw=0.8)
    mean, low, high = seed_interval(pairing.seed_means)
    bounds = "" if low is None else f" [{low:+.2f}, {high:+.2f}]"
    ax.set_title(f"{pairing.method} − {baseline}: {mean:+.2f}{bounds}, {len(pairing.seeds)} seed"
                 + "s" * (len(pairing.seeds) > 1), fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy difference (points)")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def plot_client_accuracy(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], path: str,
                         title: str = "clients' held-out accuracy",
                         styles: Sequence[Mapping[str, Any]] | None = None) -> str:
  """Per-client evaluation (``client_accuracy`` in metrics.jsonl): one panel per architecture group and one for all
  clients, each run's clients' mean (solid) and worst 10% (dashed) held-out accuracy per round, every run
  (``(label, rows)``) in its colour (``styles``: its plot keywords). Returns `path`; ValueError if no run has it."""
  from fedjax_hetero.analysis.runs import last_client_accuracy

  groups = list(dict.fromkeys(g for _, rows in runs for g in (last_client_accuracy(rows) or {})))
  if not groups:
    raise ValueError("none of the runs evaluated its clients (run with --client-eval-fraction)")
  groups = [g for g in groups if g != "all"] + ["all"]
  fig = _figure(4.2 * len(groups), 4.2)
  axes = fig.subplots(1, len(groups), squeeze=False, sharey=True)[0]
  for ax, group in zip(axes, groups):
    for index, (label, rows) in enumerate(runs):
      style = {"color": f"C{index % 10}", **(dict(styles[index]) if styles else {})}
      _client_lines(ax, label, rows, group, style, lw=1.3)
    ax.set_title("all clients" if group == "all" else f"clients of {group}")
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("held-out accuracy (%)")
  axes[-1].legend(loc="lower right", fontsize="small")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path

"""The peer benchmark's summary line (`benchmarks.peer_torch`): the jax/torch ratios of its sides' rows, medians over
the repeats, and whether both sides trained the same partition, clients, examples and models."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

SIDES = ("torch", "jax")


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  by_side = {s: [r for r in rows if r["side"] == s] for s in SIDES}

  def ratio(key: str) -> float | None:
    pairs = [(j[key], t[key]) for j, t in zip(by_side["jax"], by_side["torch"]) if j[key] and t[key]]
    return statistics.median(j / t for j, t in pairs) if pairs else None

  def same(key: str) -> bool:
    return all(r[key] == rows[0][key] for r in rows)

  drawn = [r.get("examples_drawn_per_round", r["examples_per_round"]) for r in rows]

  return {"summary": True, "ratio_samples_per_s_after_first_jax_over_torch": ratio("samples_per_s_after_first"),
          "ratio_wall_s_jax_over_torch": ratio("wall_s"), "repeats": len(by_side["jax"]),
          **{f"median_{k}_{s}": statistics.median(r[k] for r in by_side[s]) if all(r[k] for r in by_side[s]) else None
             for s in SIDES for k in ("samples_per_s_after_first", "wall_s")},
          "same_partition": same("partition_digest"), "same_clients": same("clients"),
          "same_examples": all(d == drawn[0] for d in drawn), "same_param_counts": same("param_counts"),
          "first_round_of_group": rows[0]["first_round_of_group"],
          "torch_num_threads": by_side["torch"][0]["torch_num_threads"]}

"""Differential privacy at the client, DP-FedAvg style (`fedjax_hetero.methods.privacy`): every client's update
clipped to an L2 norm, Gaussian noise on the server's sum of them, and the privacy spent (epsilon at a delta) from
an RDP accountant (`fedjax_hetero.run.privacy_accounting`). Off unless ``--dp-clip`` is given."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_hetero.config.declare import Number, OneOf, Settings, cli_name, flag_of, setting, validate
from fedjax_hetero.config.federation import FederationConfig

FLOAT32_MAX = float(np.finfo(np.float32).max)

# How the accountant models a round's draw of clients_per_round of num_clients (docs/privacy.md).
ACCOUNTANTS = ("without_replacement", "poisson")


@dataclasses.dataclass(frozen=True)
class PrivacyConfig(Settings):
  FLAG_PREFIX = "dp"
  TITLE = ("differential privacy: clipped client updates, Gaussian noise on their sum (any method whose clients "
           "upload their update alone)")

  clip: float | None = setting(
      None, "clip every client's update (all of its model's variables, as one vector) to this L2 norm C, and add "
      "Gaussian noise of standard deviation --dp-noise-multiplier x C to the server's sum of the updates; "
      "default: off (docs/privacy.md)", Number(above=0), metavar="C")
  noise_multiplier: float = setting(
      1.0, "z: the noise on each element of the sum of the clipped updates has standard deviation z x --dp-clip "
      "(0: clipping alone, no privacy bound)", Number(minimum=0), metavar="Z")
  delta: float = setting(1e-5, "the delta at which epsilon is reported (per round in metrics.jsonl, and in "
                         "summary.json)", Number(above=0, below=1))
  accountant: str = setting(
      "without_replacement", "how the RDP accountant models a round's cohort: without_replacement (a uniform draw "
      "of --clients-per-round of --num-clients, what the runs do; neighbours replace one client's data) or poisson "
      "(each client in with probability --clients-per-round / --num-clients, neighbours add or remove one client: "
      "the DP-FedAvg papers' bound, an approximation here)", OneOf(ACCOUNTANTS))

  @property
  def on(self) -> bool:
    return self.clip is not None

  def __post_init__(self):
    validate(self)
    if not self.on:
      changed = [cli_name(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "clip" and getattr(self, f.name) != f.default]
      if changed:
        raise ValueError(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} differential privacy, which "
                         f"is off: add {flag_of(self, 'clip')} C")
    elif self.noise_multiplier * self.clip > FLOAT32_MAX:  # (the noise's std, z C, is drawn in float32)
      raise ValueError(f"{cli_name(self, 'noise_multiplier')} {self.noise_multiplier:g} x {cli_name(self, 'clip')} "
                       f"{self.clip:g}, the noise's standard deviation, is beyond float32's range (largest "
                       f"{FLOAT32_MAX:.4g}): every noised model would be infinite")


def check_privacy(privacy: PrivacyConfig, federation: FederationConfig) -> None:
  """ValueError naming the flags when privacy is on with aggregation weights that are not all 1: the noise is
  calibrated to a sum in which every client's clipped update counts once."""
  if privacy.on and federation.weighting != "uniform":
    raise ValueError(f"{cli_name(privacy, 'clip')} needs {cli_name(federation, 'weighting')} uniform (got "
                     f"{federation.weighting}): the noise is calibrated to a sum in which every client's clipped "
                     "update counts once, and a weight by sample count would scale one client's share past the clip")

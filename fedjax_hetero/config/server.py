"""The server's optimizer on the round's mean update: FedAdagrad, FedYogi and FedAdam (Reddi et al., ICLR 2021,
"Adaptive Federated Optimization", Alg. 2), for any method whose server applies a mean update
(`fedjax_hetero.methods.adaptive`). The defaults are the paper's fixed choices: beta1 0.9, beta2 0.99,
tau 1e-3; it tunes the server learning rate per task on a grid of powers of ten."""

from __future__ import annotations

import dataclasses

from fedjax_hetero.config.declare import Number, OneOf, Settings, cli_name, flag_of, setting, validate

SERVER_OPTIMIZERS = ("none", "adam", "yogi", "adagrad")


@dataclasses.dataclass(frozen=True)
class ServerOptimizerConfig(Settings):
  FLAG_PREFIX = "server"
  TITLE = "server optimizer: FedAdam, FedYogi, FedAdagrad (any method with a mean update)"

  optimizer: str = setting(
      "none", "apply the round's mean update through an adaptive optimizer (Reddi et al. 2021): adam, yogi or "
      "adagrad; none: add it as it is", OneOf(SERVER_OPTIMIZERS))
  lr: float = setting(1e-2, "server learning rate eta of --server-optimizer", Number(above=0))
  beta1: float = setting(0.9, "momentum beta1 of --server-optimizer", Number(minimum=0, below=1))
  beta2: float = setting(0.99, "second-moment decay beta2 of --server-optimizer adam and yogi",
                         Number(minimum=0, below=1))
  tau: float = setting(1e-3, "adaptivity tau of --server-optimizer: steps divide by sqrt(v) + tau, and v starts "
                       "at tau^2", Number(above=0))

  def __post_init__(self):
    validate(self)
    if self.optimizer == "none":
      changed = [cli_name(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "optimizer" and getattr(self, f.name) != f.default]
      if changed:
        raise ValueError(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} the server optimizer, and "
                         f"there is none: add {flag_of(self, 'optimizer')} adam, yogi or adagrad")
    elif self.optimizer == "adagrad" and self.beta2 != ServerOptimizerConfig.beta2:
      raise ValueError(f"{cli_name(self, 'beta2')} {self.beta2:g} has no effect with {cli_name(self, 'optimizer')} "
                       "adagrad, whose second moment sums the squared updates (Reddi et al. 2021, Alg. 2): drop it")

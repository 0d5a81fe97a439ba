"""A run's settings as plain data: one tree of frozen dataclasses, each setting declared once.

`RunConfig` is the tree; `declare` is how a setting is declared (its default, help and check) and how its
flag name, command-line flag and ``config.json`` key follow from the declaration. The modules here import
nothing of the engine, the methods or the runner: they sit at the bottom, and the run's build step
(`fedjax_hetero.run.build`) turns a config into the objects the engine runs.
"""

from fedjax_hetero.config import declare
from fedjax_hetero.config.client import OPTIMIZERS, LocalConfig
from fedjax_hetero.config.data import NORMALIZATIONS, DataConfig
from fedjax_hetero.config.distributed import DistributedConfig
from fedjax_hetero.config.federation import FederationConfig, check_federation
from fedjax_hetero.config.methods import (AGGREGATE_MODES, Averaging, ClusteredSampling, Contrastive, CrossLayer,
                                          FedFAOptions, HeteroFLOptions, MethodConfig, MomentumDistillation,
                                          NeFLOptions, Proximal)
from fedjax_hetero.config.options import FedCrossConfig, FedGenConfig, FedINConfig, FedImproConfig
from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.config.run import (BACKEND_NAMES, FLAGS, DivergenceConfig, OutputConfig, RunConfig, as_dict,
                                      cli_flag, flatten, from_dict, typed_flag)

__all__ = ["AGGREGATE_MODES", "Averaging", "BACKEND_NAMES", "ClusteredSampling", "Contrastive", "CrossLayer",
           "DataConfig", "DistributedConfig", "DivergenceConfig", "FLAGS", "FedCrossConfig", "FedFAOptions",
           "FedGenConfig", "FedINConfig", "FedImproConfig", "FederationConfig", "HeteroFLOptions", "LocalConfig",
           "MethodConfig", "MomentumDistillation", "NORMALIZATIONS", "NeFLOptions", "OPTIMIZERS", "OutputConfig",
           "PrivacyConfig", "Proximal", "RunConfig", "as_dict", "check_federation", "cli_flag", "declare", "flatten",
           "from_dict", "typed_flag"]

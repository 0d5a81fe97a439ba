"""The round: a frozen spec (`RoundSpec`), the rows a call reads (`inputs`), one round body (`body`), the seam of how
cohorts are mapped (`mapping`, `backends`) and the simulation that runs calls of rounds (`simulation`); many runs
of one program (`many`). See docs/architecture.md."""

from fedjax_hetero.rounds.backends import BACKENDS, make_backend
from fedjax_hetero.rounds.rows import NonFiniteLossError
from fedjax_hetero.rounds.simulation import Simulation, make_simulation
from fedjax_hetero.rounds.spec import ArchGroup, RoundSpec, assign_groups
from fedjax_hetero.rounds.state import ServerState

__all__ = ["ArchGroup", "BACKENDS", "NonFiniteLossError", "RoundSpec", "ServerState", "Simulation", "assign_groups",
           "make_backend", "make_simulation"]

"""The survey's library probes: misuse of the documented entry points, in this process.

`FederatedStore.build`, `RoundSpec.build` and `make_simulation`, `build_model`, `ArrayDataset` and the public aggregators, each given
one bad argument; the right answer is a ValueError (or TypeError) naming the argument, raised before any
compute.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
import numpy as np

from fedjax_hetero import aggregators as A
from fedjax_hetero.config import FederationConfig, LocalConfig
from fedjax_hetero.data import partition, synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero import build_group_map
from fedjax_hetero.methods import MethodConfig, build_method
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import ArchGroup, RoundSpec, Simulation, make_simulation
from fedjax_hetero.rounds.backends import make_backend
from scripts.survey_common import Error, Result, call

DATA = synthetic_dataset(num_train=120, num_test=40, seed=0)
PARTS = partition(DATA.train_labels, "iid", 4, 0)
LOCAL = LocalConfig(epochs=1, batch_size=8, optimizer="sgd", learning_rate=0.05)


@dataclasses.dataclass(frozen=True)
class LibraryProbe:
  family: str
  name: str
  run: Callable[[], Result]
  expect: Error


def store(**changes) -> FederatedStore:
  arguments = dict(images=DATA.train_images, labels=DATA.train_labels, parts=PARTS, num_classes=DATA.num_classes,
                   mean=DATA.mean, std=DATA.std)
  return FederatedStore.build(**{**arguments, **changes})


def simulation(groups=None, local=LOCAL, method_local=LOCAL, method="FedAvg", test_images=None, test_labels=None,
               data_store=None, method_object=None, backend=None) -> Simulation:
  """Two MLP groups over the four clients, any argument replaced, after one round and an evaluation (what a
  bad input does if nothing stops it)."""
  data_store = data_store or store()
  model = lambda w: build_model("mlp", DATA.num_classes, w, hidden=(8,))
  groups = groups if groups is not None else [ArchGroup("mlp@1", model(1.0), np.array([0, 1])),
                                              ArchGroup("mlp@0.5", model(0.5), np.array([2, 3]))]
  method_object = method_object if method_object is not None else build_method(method, MethodConfig(), method_local)
  spec = RoundSpec.build(groups, data_store, local, method_object, FederationConfig(clients_per_round=2),
                         jnp.asarray(DATA.test_images if test_images is None else test_images),
                         jnp.asarray(DATA.test_labels if test_labels is None else test_labels))
  sim = make_simulation(spec, backend if backend is not None else make_backend("sequential"))
  state, _ = sim.run_rounds(sim.init_state(), 1)
  sim.evaluate(state)
  return sim


def _groups(*client_lists):
  model = build_model("mlp", DATA.num_classes, 1.0, hidden=(8,))
  return [ArchGroup(f"g{i}", model, np.asarray(c, np.int64)) for i, c in enumerate(client_lists)]


def _hetero_avg(weights):
  shapes = {"params": {"w": jnp.zeros((3, 2))}}
  group_map = build_group_map(shapes, shapes, "g")
  return A.hetero_avg(shapes, [shapes] * len(weights), weights, [group_map] * len(weights))


def in_a_run(**changes) -> Simulation:
  return simulation(data_store=store(**changes))


def probe(name: str, fn: Callable[[], object], *fragments: str) -> LibraryProbe:
  return LibraryProbe("library misuse", name, functools.partial(call, fn), Error(fragments))


PROBES = [
    probe("store: float images in [0, 1]", lambda: in_a_run(images=DATA.train_images / 255.0), "images", "uint8"),
    probe("store: negative sample id", lambda: in_a_run(parts=[np.array([-1, 2])] + PARTS[1:]), "parts", "-1"),
    probe("store: sample id past the images", lambda: in_a_run(parts=[np.array([0, 500])] + PARTS[1:]), "parts", "500"),
    probe("store: float sample ids", lambda: in_a_run(parts=[p.astype(float) + 0.5 for p in PARTS]), "parts", "integer"),
    probe("store: labels shorter than the images", lambda: in_a_run(labels=DATA.train_labels[:-5]), "labels"),
    probe("store: label past num_classes", lambda: in_a_run(num_classes=2), "num_classes"),
    probe("store: one class", lambda: in_a_run(labels=np.zeros_like(DATA.train_labels), num_classes=1), "num_classes"),
    probe("store: std 0", lambda: in_a_run(std=(0.0,)), "std"),
    probe("store: NaN mean", lambda: in_a_run(mean=(float("nan"),)), "mean"),
    probe("store: a mean per channel missing", lambda: in_a_run(mean=(0.5, 0.5)), "mean"),
    probe("store: 3-D images", lambda: in_a_run(images=DATA.train_images[..., 0]), "images"),
    probe("Simulation: two groups claim client 1", lambda: simulation(groups=_groups([0, 1], [1, 2, 3])),
          "client", "1"),
    probe("Simulation: an empty group", lambda: simulation(groups=_groups([0, 1, 2, 3], [])), "group", "g1"),
    probe("Simulation: a client id past the store", lambda: simulation(groups=_groups([0, 1], [2, 3, 9])), "9"),
    probe("Simulation: negative client id", lambda: simulation(groups=_groups([0, 1, -1], [2, 3])), "-1"),
    probe("Simulation: two groups of one name",
          lambda: simulation(groups=[dataclasses.replace(g, name="same") for g in _groups([0, 1], [2, 3])]), "same"),
    probe("Simulation: test labels shorter", lambda: simulation(test_labels=DATA.test_labels[:-3]), "test_labels"),
    probe("Simulation: test label past the classes",
          lambda: simulation(test_labels=DATA.test_labels + DATA.num_classes), "test_labels"),
    probe("Simulation: float test images", lambda: simulation(test_images=DATA.test_images / 255.0), "test_images"),
    probe("Simulation: test images of another size", lambda: simulation(test_images=DATA.test_images[:, :4]),
          "test_images"),
    probe("Simulation: SCAFFOLD built for lr 0.5, run at 0.05",
          lambda: simulation(method="SCAFFOLD", method_local=dataclasses.replace(LOCAL, learning_rate=0.5)),
          "learning_rate"),
    probe("Simulation: FedNova built for adam, run with sgd",
          lambda: simulation(method="FedNova", method_local=dataclasses.replace(LOCAL, optimizer="adam")),
          "optimizer"),
    probe("Simulation: lr 1e-50 (0 in float32)",
          lambda: simulation(local=dataclasses.replace(LOCAL, learning_rate=1e-50),
                             method_local=dataclasses.replace(LOCAL, learning_rate=1e-50)), "learning_rate"),
    probe("build_model: one class", lambda: build_model("cnn", 1), "num_classes"),
    probe("build_model: classes as text", lambda: build_model("cnn", "10"), "num_classes"),
    probe("build_model: an unknown setting", lambda: build_model("cnn", 10, depthh=3), "depthh"),
    probe("ArrayDataset: one class",
          lambda: dataclasses.replace(DATA, train_labels=np.zeros_like(DATA.train_labels),
                                      test_labels=np.zeros_like(DATA.test_labels), num_classes=1), "num_classes"),
    probe("ArrayDataset: std 0", lambda: dataclasses.replace(DATA, std=(0.0,)), "std"),
    probe("hetero_avg: a weight as text", lambda: _hetero_avg(["1", 1.0]), "group_weights[0]"),
    probe("hetero_avg: a weight None", lambda: _hetero_avg([None, 1.0]), "group_weights[0]"),
    probe("fedavg: weight None", lambda: A.fedavg({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, None), "weight"),
    probe("fedavg: weight as text", lambda: A.fedavg({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, "2"), "weight"),
    probe("fedavg: infinite weight", lambda: A.fedavg({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, np.inf), "weight"),
    probe("cross_aggregate: partners as text",
          lambda: A.cross_aggregate({"w": jnp.zeros((2, 3))}, ["1", "0"], 0.5), "partners"),
]

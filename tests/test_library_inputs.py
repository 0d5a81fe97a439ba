"""The documented entry points refuse bad inputs, naming the argument, before anything is traced or computed:
`FederatedStore.build`, `ArrayDataset`, `RoundSpec.build` and `make_simulation`, `build_model` and the aggregators' weights.

To probe a new misuse, add one line to `MISUSE`: a description, the bad call and a regex of the ValueError.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators as A
from fedjax_hetero.config import FederationConfig, LocalConfig
from fedjax_hetero.data import partition, synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero import build_group_map
from fedjax_hetero.methods import MethodConfig, build_method
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import ArchGroup, RoundSpec, make_backend, make_simulation

DATA = synthetic_dataset(num_train=120, num_test=40, seed=0)
PARTS = partition(DATA.train_labels, "iid", 4, 0)
LOCAL = LocalConfig(epochs=1, batch_size=8, optimizer="sgd", learning_rate=0.05)


def store(**changes) -> FederatedStore:
  arguments = dict(images=DATA.train_images, labels=DATA.train_labels, parts=PARTS, num_classes=DATA.num_classes,
                   mean=DATA.mean, std=DATA.std)
  return FederatedStore.build(**{**arguments, **changes})


def groups(*client_lists, name=None):
  model = build_model("mlp", DATA.num_classes, 1.0, hidden=(8,))
  return [ArchGroup(name or f"g{i}", model, np.asarray(c)) for i, c in enumerate(client_lists)]


def simulation(groups=None, local=LOCAL, method_local=LOCAL, method="FedAvg", test_images=DATA.test_images,
               test_labels=DATA.test_labels, model="mlp"):
  """Two groups over the four clients of `store()`, any argument replaced."""
  model = build_model(model, DATA.num_classes, 1.0, **({"hidden": (8,)} if model == "mlp" else {}))
  groups = groups if groups is not None else [ArchGroup("a", model, np.array([0, 1])),
                                              ArchGroup("b", model, np.array([2, 3]))]
  spec = RoundSpec.build(groups, store(), local, build_method(method, MethodConfig(), method_local),
                         FederationConfig(clients_per_round=2), jnp.asarray(test_images), jnp.asarray(test_labels))
  return make_simulation(spec, make_backend("sequential"))


def hetero_avg(weights):
  tree = {"params": {"w": jnp.zeros((3, 2))}}
  group_map = build_group_map(tree, tree, "g")
  return A.hetero_avg(tree, [tree] * len(weights), weights, [group_map] * len(weights))


call = functools.partial
ZERO, ONE = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}

MISUSE = [
    # FederatedStore.build
    ("store: float images in [0, 1]", call(store, images=DATA.train_images / 255.0),
     r"^images must be uint8 pixels in \[0, 255\].*got float64 \(floats in \[0, 1\]\? multiply by 255"),
    ("store: 3-D images", call(store, images=DATA.train_images[..., 0]), r"^images must have shape \[N, H, W, C\]"),
    ("store: labels shorter", call(store, labels=DATA.train_labels[:-5]), r"^labels must be integer class ids of shape "
                                                                          r"\(120,\), one per image, got int32 \(115,\)"),
    ("store: float labels", call(store, labels=DATA.train_labels * 1.0), r"^labels must be integer class ids"),
    ("store: a label past num_classes", call(store, num_classes=2), r"^labels holds class 3, outside \[0, 2\)"),
    ("store: one class", call(store, num_classes=1), r"^num_classes must be an integer >= 2, got 1"),
    ("store: std 0", call(store, std=(0.0,)), r"^std\[0\] must be > 0"),
    ("store: NaN mean", call(store, mean=(float("nan"),)), r"^mean\[0\] must be a finite number, got nan"),
    ("store: a mean per channel missing", call(store, mean=(0.5, 0.5)), r"^mean needs one value per image channel \(1\)"),
    ("store: a negative sample id", call(store, parts=[np.array([-1, 2]), *PARTS[1:]]),
     r"^parts\[0\] holds sample id -1, outside the 120 images"),
    ("store: a sample id past the images", call(store, parts=[np.array([0, 500]), *PARTS[1:]]),
     r"^parts\[0\] holds sample id 500"),
    ("store: float sample ids", call(store, parts=[p + 0.5 for p in PARTS]), r"^parts\[0\] must be a 1-D array of "
                                                                             r"integer sample ids, got float64"),
    ("store: no client", call(store, parts=[]), r"^parts must be a non-empty sequence"),
    ("store: a client with no sample", call(store, parts=[np.array([], np.int64), *PARTS[1:]]),
     r"^parts\[0\] holds no sample: every client needs at least one"),
    # ArrayDataset
    ("dataset: one class", call(dataclasses.replace, DATA, train_labels=np.zeros_like(DATA.train_labels),
                                test_labels=np.zeros_like(DATA.test_labels), num_classes=1),
     r"^num_classes must be an integer >= 2, got 1"),
    ("dataset: std 0", call(dataclasses.replace, DATA, std=(0.0,)), r"^std\[0\] must be > 0"),
    # Simulation
    ("Simulation: two groups claim client 1", call(simulation, groups([0, 1], [1, 2, 3])),
     r"^client 1 is in groups\[0\] \(g0\) and groups\[1\] \(g1\); a client belongs to one architecture group"),
    ("Simulation: an empty group", call(simulation, groups([0, 1, 2, 3], [])), r"^groups\[1\] \(g1\) has no client"),
    ("Simulation: no group", call(simulation, []), r"^groups must be a non-empty sequence of ArchGroup"),
    ("Simulation: a client past the store", call(simulation, groups([0, 1], [2, 3, 9])),
     r"^groups\[1\] \(g1\) holds client 9, outside the store's 4 clients"),
    ("Simulation: a negative client", call(simulation, groups([0, 1, -1], [2, 3])), r"holds client -1, outside"),
    ("Simulation: a client listed twice", call(simulation, groups([0, 1, 1], [2, 3])), r"lists a client twice"),
    ("Simulation: float client ids", call(simulation, groups([0.0, 1.0], [2, 3])), r"integer client ids, got float64"),
    ("Simulation: two groups of one name", call(simulation, groups([0, 1], [2, 3], name="same")),
     r"^two groups are named 'same'; group names key the metrics"),
    ("Simulation: test labels shorter", call(simulation, test_labels=DATA.test_labels[:-3]),
     r"^test_labels must be integer class ids of shape \(40,\)"),
    ("Simulation: a test label past the classes", call(simulation, test_labels=DATA.test_labels + 4),
     r"^test_labels holds class \d, outside \[0, 4\)"),
    ("Simulation: float test images", call(simulation, test_images=DATA.test_images / 255.0),
     r"^test_images must be uint8 pixels"),
    ("Simulation: test images of another size", call(simulation, test_images=DATA.test_images[:, :4]),
     r"^test_images have images of shape \(4, 8, 1\), the training store \(8, 8, 1\)"),
    ("Simulation: no test image", call(simulation, test_images=DATA.test_images[:0], test_labels=DATA.test_labels[:0]),
     r"^test_images holds no image"),
    ("Simulation: a model of another class count", call(simulation, [ArchGroup("a", build_model(
        "mlp", 3, 1.0, hidden=(8,)), np.arange(4))]),
     r"^groups\[0\] \(a\): its model gives 3 logits, but the data have 4 classes; build it with num_classes=4"),
    ("Simulation: images too small for a CIFAR CNN", call(simulation, model="cnn_cifar"),
     r"^groups\[0\] \(a\): its model cannot take images of shape \(8, 8, 1\) \(ZeroDivisionError"),
    ("Simulation: SCAFFOLD built for another lr", call(simulation, method="SCAFFOLD",
                                                        method_local=dataclasses.replace(LOCAL, learning_rate=0.5)),
     r"^method Scaffold was built with local.learning_rate=0.5, but the simulation trains with "
     r"local.learning_rate=0.05; build it with the simulation's LocalConfig"),
    ("Simulation: FedNova built for adam", call(simulation, method="FedNova",
                                                method_local=dataclasses.replace(LOCAL, optimizer="adam")),
     r"^method FedNova was built with local.optimizer='adam', but the simulation trains with local.optimizer='sgd'"),
    ("LocalConfig: lr 1e-50", call(LocalConfig, learning_rate=1e-50),
     r"^--lr 1e-50 is 0 in float32 training arithmetic"),
    ("Simulation: the method by name", call(RoundSpec.build, groups([0, 1], [2, 3]), store(), LOCAL, "FedAvg",
                                           FederationConfig(), DATA.test_images, DATA.test_labels),
     r"^method must be a Method \(build_method"),
    ("Simulation: local as a dict", call(simulation, local={"learning_rate": 0.1}), r"^local must be a LocalConfig"),
    ("Simulation: the backend by name", call(make_simulation, simulation().spec, "vmap"),
     r"^backend must be a Backend"),
    ("Simulation: a negative count of rounds", call(lambda sim: sim.run_rounds(None, -1), simulation()),
     r"^count must be an integer >= 0, got -1"),  # (held-out probe 52: no rows, no word)
    # build_model
    ("build_model: one class", call(build_model, "cnn", 1), r"^num_classes must be an integer >= 2, got 1"),
    ("build_model: classes as text", call(build_model, "cnn", "10"), r"^num_classes must be an integer >= 2, got '10'"),
    ("build_model: an unknown setting", call(build_model, "cnn", 10, depthh=3),
     r"^model 'cnn' has no setting 'depthh'; accepted overrides: channels, hidden, scaler"),
    # aggregators' weights
    ("hetero_avg: a weight as text", call(hetero_avg, ["1", 1.0]), r"^group_weights\[0\] must be a number, got '1'"),
    ("hetero_avg: a weight None", call(hetero_avg, [None, 1.0]), r"^group_weights\[0\] must be a number, got None"),
    ("fedavg: weight None", call(A.fedavg, ZERO, ONE, None), r"^weight must be a number, got None"),
    ("fedavg: weight as text", call(A.fedavg, ZERO, ONE, "2"), r"^weight must be a number, got '2'"),
    ("fedavg: an object array", call(A.fedavg, ZERO, ONE, np.array(None)), r"^weight must be a number.*dtype object"),
    # aggregators' models
    ("FedFA: a NaN kernel's norm", call(A.trimmed_norm, jnp.array([[1.0, jnp.nan], [2.0, 3.0]])),
     r"^x leaf \(the array\) holds a non-finite value"),
    ("FedCross: integer models", call(A.cross_aggregate, {"w": jnp.arange(6).reshape(3, 2)},
                                      jnp.array([1, 2, 0]), 0.9),
     r"^uploaded leaf w is int32; the aggregators take floating-point weights"),
    ("InCo: a pair given as one string", call(A.check_pairs, ["params/conv1/kernel"], {"params": {}}),
     r"^a cross-layer pair must be \(target_path, source_path\).*got 'params/conv1/kernel'"),
]


@pytest.mark.parametrize("make_call, pattern", [c[1:] for c in MISUSE], ids=[c[0] for c in MISUSE])
def test_library_misuse_raises_a_value_error_naming_the_argument(make_call, pattern, no_compute):
  with pytest.raises(ValueError, match=pattern):
    make_call()


def test_each_case_is_listed_once_and_the_good_inputs_pass():
  assert len({c[0] for c in MISUSE}) == len(MISUSE)
  assert store().num_clients == 4
  sim = simulation()
  assert [g.name for g in sim.spec.groups] == ["a", "b"]
  assert dict(build_method("SCAFFOLD", MethodConfig(), LOCAL).local_settings) == {"learning_rate": 0.05}
  assert build_method("FedAvg", MethodConfig(), LOCAL).local_settings == ()
  assert float(A.fedavg(ZERO, ONE, np.float32(2.0))["w"][0]) == 0.5

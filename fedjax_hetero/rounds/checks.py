"""The checks of a `RoundSpec`'s inputs (`RoundSpec.build`), run before anything is traced or computed.

Groups that share a client, an empty group, client ids outside the store (a gather would clamp them), two
groups of one name (their metrics would overwrite each other), a test set whose labels do not match its images
or the store's classes, images a group's model cannot take or a class count it does not give, and a method built for other local-training settings than the simulation's (SCAFFOLD's correction uses the
learning rate, FedNova's normalization the optimizer): each is a ValueError naming the argument.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from fedjax_hetero.config import FederationConfig, LocalConfig
from fedjax_hetero.data import checks
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.methods.api import Method
from fedjax_hetero.models.common import output_shape, variable_shapes
from fedjax_hetero.validation import first_line

def _check_group(index: int, group: Any, num_clients: int) -> np.ndarray:
  """The group's client ids, checked: a non-empty 1-D integer array of distinct ids in [0, num_clients)."""
  where = f"groups[{index}] ({getattr(group, 'name', '?')})"
  if not all(hasattr(group, field) for field in ("name", "model", "clients")):
    raise ValueError(f"groups[{index}] must be an ArchGroup(name, model, clients), got {type(group).__name__}")
  ids = np.asarray(group.clients)
  if ids.size == 0:
    raise ValueError(f"{where} has no client; every architecture group needs at least one")
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{where}: clients must be a 1-D array of integer client ids, got {ids.dtype} {ids.shape}")
  if ids.min() < 0 or ids.max() >= num_clients:
    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
    raise ValueError(f"{where} holds client {bad}, outside the store's {num_clients} clients [0, {num_clients})")
  if len(np.unique(ids)) != len(ids):
    raise ValueError(f"{where} lists a client twice")
  return ids


def check_groups(groups: Sequence[Any], num_clients: int) -> None:
  """Non-empty, uniquely named groups whose client lists are valid and disjoint."""
  if isinstance(groups, (str, bytes)) or not hasattr(groups, "__len__") or not len(groups):
    raise ValueError("groups must be a non-empty sequence of ArchGroup")
  owner: dict[int, int] = {}
  for index, group in enumerate(groups):
    for client in _check_group(index, group, num_clients).tolist():
      if client in owner:
        raise ValueError(f"client {client} is in groups[{owner[client]}] ({groups[owner[client]].name}) and "
                         f"groups[{index}] ({group.name}); a client belongs to one architecture group")
      owner[client] = index
  names = [g.name for g in groups]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"two groups are named {repeated[0]!r}; group names key the metrics, so each must be unique")


def check_test_set(test_images: Any, test_labels: Any, store: FederatedStore) -> None:
  """uint8 test images shaped like the store's, one label per image, each a class of the store."""
  shape = checks.check_images("test_images", test_images)
  if shape[1:] != tuple(store.images.shape[1:]):
    raise ValueError(f"test_images have images of shape {shape[1:]}, the training store {tuple(store.images.shape[1:])}")
  if shape[0] == 0:
    raise ValueError("test_images holds no image; the evaluation needs at least one")
  checks.check_labels("test_labels", test_labels, shape[0], store.num_classes)


def check_models(groups: Sequence[Any], image_shape: tuple[int, ...], num_classes: int) -> None:
  """Every group's model takes images of ``image_shape`` and gives one logit per class (traced for shapes only)."""
  for index, group in enumerate(groups):
    try:
      shapes = variable_shapes(group.model, image_shape)
    except Exception as e:  # noqa: BLE001 - whatever the model raises on an input it cannot take
      raise ValueError(f"groups[{index}] ({group.name}): its model cannot take images of shape {image_shape} "
                       f"({first_line(e, 200)})") from None
    if any(0 in leaf.shape for leaf in jax.tree.leaves(shapes)):
      raise ValueError(f"groups[{index}] ({group.name}): images of shape {image_shape} are too small for its model "
                       "(a layer would have no values)")
    logits = output_shape(group.model, image_shape)
    if getattr(logits, "shape", (num_classes,))[-1:] != (num_classes,):
      raise ValueError(f"groups[{index}] ({group.name}): its model gives {logits.shape[-1]} logits, but the data have "
                       f"{num_classes} classes; build it with num_classes={num_classes}")


def check_local(local: Any, method: Any) -> None:
  """The settings the method was built with (its ``local_settings``, see `fedjax_hetero.methods.build_method`)
  equal to the simulation's."""
  for field, built_with in getattr(method, "local_settings", ()):
    now = getattr(local, field)
    if now != built_with:
      raise ValueError(f"method {method.name} was built with local.{field}={built_with!r}, but the simulation trains "
                       f"with local.{field}={now!r}; build it with the simulation's LocalConfig "
                       "(build_method(name, options, local))")


def check_types(store: Any, local: Any, method: Any, config: Any) -> None:
  """Each argument of the type it must have (a name or a dict in its place fails deep inside, unnamed)."""
  for name, value, kind, how in (("store", store, FederatedStore, "FederatedStore.build(...)"),
                                 ("local", local, LocalConfig, "LocalConfig(...)"),
                                 ("method", method, Method, "build_method(name, options, local)"),
                                 ("config", config, FederationConfig, "FederationConfig(...)")):
    if not isinstance(value, kind):
      raise ValueError(f"{name} must be a {kind.__name__} ({how}), got {type(value).__name__} {value!r:.60}")


def check_simulation_inputs(groups: Sequence[Any], store: Any, local: Any, method: Any, config: Any,
                            test_images: Any, test_labels: Any) -> None:
  """All of the above, in the order a user would fix them; `RoundSpec.build` calls it first."""
  check_types(store, local, method, config)
  check_groups(groups, store.num_clients)
  check_test_set(test_images, test_labels, store)
  check_local(local, method)
  check_models(groups, tuple(store.images.shape[1:]), store.num_classes)

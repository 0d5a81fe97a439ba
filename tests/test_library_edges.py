"""Bad input to the library's public functions, each refused where it enters with an error that names the argument.

Before these checks, each call below raised numpy's, jax's, flax's or dp-accounting's own error (an OverflowError,
an IndexError, ``scale < 0``, a broadcast failure, a bare AssertionError, ``KeyError: 'sgd'``) or was silently
accepted (a negative clip flipped the update's sign, a dropout probability of nan meant that everyone answers). To
probe a new edge, add one line to its family: the call and the error's type and a fragment of its message.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators as A
from fedjax_hetero.cli import run as cli
from fedjax_hetero.config import LocalConfig, PrivacyConfig, RunConfig, as_dict, from_dict
from fedjax_hetero.data import (class_counts, hold_out, load_partition_file, partition, resize_images,
                                save_partition_file, synthetic_dataset)
from fedjax_hetero.methods import PER_GROUP, Method, register_method
from fedjax_hetero.methods.adaptive import scale_by_adaptive_moments
from fedjax_hetero.methods.privacy import clip_term, clipped
from fedjax_hetero.run.privacy_accounting import epsilon
from fedjax_hetero.sampling import pairwise_dissimilarity, similarity_clusters, size_clusters
from fedjax_hetero.sampling.availability import availability
from tests.helpers import tiny_simulation

call = functools.partial
LABELS = np.repeat(np.arange(4), 25).astype(np.int32)
PARTS = [np.arange(0, 50), np.arange(50, 100)]
IMAGES = np.zeros((2, 8, 8, 1), np.uint8)
ANSWERS = availability((0.5,), [], num_groups=1, num_clients=8, seed=0)


def refused(case):
  _, bad_call, error, fragment = case
  with pytest.raises(error, match=fragment):
    bad_call()


def cases(family):
  return pytest.mark.parametrize("case", family, ids=[case[0] for case in family])


# (description, bad call, error type, regex of a fragment of its message)
DATA = [
    ("partition: negative seed", call(partition, LABELS, "iid", 4, -1), ValueError, r"^seed must be an integer >= 0"),
    ("partition dirichlet: text seed", call(partition, LABELS, "dirichlet", 2, "0"), ValueError, r"^seed must be"),
    ("hold_out: fraction as text", call(hold_out, PARTS, "0.5", 0), TypeError, r"fraction must be a number.*'0.5'"),
    ("hold_out: 2-D part", call(hold_out, [np.arange(6).reshape(2, 3)], 0.5, 0), ValueError,
     r"^parts\[0\] must be a 1-D array of integer sample ids, got int64 \(2, 3\)"),
    ("hold_out: negative seed", call(hold_out, PARTS, 0.5, -2), ValueError, r"^seed must be an integer >= 0"),
    ("synthetic_dataset: negative noise", call(synthetic_dataset, noise_std=-1.0), ValueError,
     r"^noise_std must be a finite number >= 0, got -1.0"),
    ("synthetic_dataset: nan noise", call(synthetic_dataset, noise_std=float("nan")), ValueError,
     r"^noise_std must be a finite number >= 0, got nan"),
    ("synthetic_dataset: a 0 in image_shape", call(synthetic_dataset, image_shape=(8, 8, 0)), ValueError,
     r"^image_shape must be \(H, W, C\), three integers >= 1, got \(8, 8, 0\)"),
    ("synthetic_dataset: float num_classes", call(synthetic_dataset, num_classes=2.5), ValueError,
     r"^num_classes must be an integer >= 2, got 2.5"),
    ("synthetic_dataset: float num_train", call(synthetic_dataset, num_train=10.0), ValueError, r"^num_train must be"),
    ("ArrayDataset.subset: float size", lambda: synthetic_dataset().subset(10.5, None), ValueError,
     r"^num_train must be None or an integer in \[0, 512\].*got 10.5"),
    ("ArrayDataset.subset: negative test size", lambda: synthetic_dataset().subset(None, -1), ValueError,
     r"^num_test must be None or an integer"),
    ("resize_images: negative size", call(resize_images, IMAGES, -3), ValueError, r"^size must be an integer >= 1"),
    ("resize_images: size 0", call(resize_images, IMAGES, 0), ValueError, r"^size must be an integer >= 1, got 0"),
    ("resize_images: float pixels", call(resize_images, IMAGES.astype(np.float32), 4), ValueError,
     r"^images must be uint8 pixels"),
    ("class_counts: index past the labels", call(class_counts, LABELS, [np.array([0, 500])], 4), ValueError,
     r"^parts\[0\] holds sample id 500, outside the 100 samples of labels"),
    ("class_counts: negative index", call(class_counts, LABELS, [np.array([0, -1])], 4), ValueError,
     r"^parts\[0\] holds sample id -1"),
    ("save_partition_file: float ids", lambda: save_partition_file("/nonexistent/p.npz", [np.array([1.7, 2.2])]),
     ValueError, r"^parts\[0\] must be a 1-D array of integer sample ids, got float64"),
]


@cases(DATA)
def test_data_functions_name_the_bad_argument(case):
  refused(case)


def test_a_partition_file_index_beyond_int64_names_the_client_and_index(tmp_path):
  path = tmp_path / "p.json"
  path.write_text(json.dumps([[0, 1], [2, 10 ** 20]]))
  with pytest.raises(ValueError, match=r"^client 1 holds sample index 100000000000000000000, outside the range of a "
                                       r"64-bit integer"):
    load_partition_file(str(path))
  np.savez(tmp_path / "u.npz", **{"0": np.array([0, 2 ** 64 - 1], np.uint64)})
  with pytest.raises(ValueError, match=r"^client 0 holds sample index 18446744073709551615"):
    load_partition_file(str(tmp_path / "u.npz"))


def test_the_cli_gives_one_error_line_for_a_partition_index_beyond_int64(tmp_path, capsys, no_compute):
  path = tmp_path / "p.json"
  path.write_text(json.dumps([list(range(i, 512, 4)) for i in range(3)] + [[3, 10 ** 20]]))
  argv = ["--dataset", "synthetic", "--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2", "--rounds",
          "2", "--no-progress", "--output-dir", str(tmp_path / "out"), "--partition-file", str(path)]
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  err = capsys.readouterr().err
  assert info.value.code == 2 and "Traceback" not in err, err
  assert err.strip().splitlines() == [f"error: --partition-file '{path}': client 3 holds sample index "
                                      "100000000000000000000, outside the range of a 64-bit integer (no training set "
                                      "has that many samples)"]


SAMPLING = [
    ("availability: 2 probabilities for 3 groups", call(availability, (0.6, 0.0), [], 3, 8, 0), ValueError,
     r"^drop_probability takes one probability, or one per architecture group \(3\), got 2"),
    ("availability: probability 1.5", call(availability, (1.5,), [], 1, 8, 0), ValueError,
     r"^drop_probability\[0\] must be a finite number in \[0, 1\], got 1.5"),
    ("availability: probability nan", call(availability, (float("nan"),), [], 1, 8, 0), ValueError,
     r"^drop_probability\[0\] must be a finite number in \[0, 1\], got nan"),
    ("availability: probability -0.5", call(availability, (-0.5,), [], 1, 8, 0), ValueError,
     r"^drop_probability\[0\] must be .* got -0.5"),
    ("availability: trace client 99 of 8", call(availability, (), [(99, 1)], 1, 8, 0), ValueError,
     r"^absent\[0\]'s client must be an integer in \[0, 7\], got 99"),
    ("availability: trace round 0", call(availability, (), [(1, 0)], 1, 8, 0), ValueError,
     r"^absent\[0\]'s round \(rounds count from 1\) must be an integer >= 1, got 0"),
    ("Availability.answers: client 20 of 8", call(ANSWERS.answers, np.array([0, 20]), np.array([0, 0]), 0),
     ValueError, r"^clients holds 20, outside the 8 clients"),
    ("Availability.answers: group 1 of 1", call(ANSWERS.answers, np.array([0, 1]), np.array([0, 1]), 0), ValueError,
     r"^groups holds 1, outside the 1 architecture groups"),
    ("pairwise_dissimilarity: 3 against 4 columns", call(pairwise_dissimilarity, np.ones((2, 3)), np.ones((2, 4))),
     ValueError, r"^a and b must be \[P, D\] and \[Q, D\] arrays of the same D.*\(2, 3\) and \(2, 4\)"),
    ("pairwise_dissimilarity: 1-D rows", call(pairwise_dissimilarity, np.ones(3), np.ones((2, 3))), ValueError,
     r"^a and b must be"),
    ("size_clusters: a negative size", call(size_clusters, np.array([5, -3]), 1), ValueError,
     r"^sizes holds -3 \(client 1\)"),
    ("size_clusters: all sizes 0", call(size_clusters, np.array([0, 0, 0]), 2), ValueError,
     r"^sizes must count at least one sample"),
    ("size_clusters: float sizes", call(size_clusters, np.array([1.5, 2.0]), 1), ValueError,
     r"^sizes must be a 1-D array of integer sample counts"),
    ("size_clusters: num_sampled 0", call(size_clusters, np.array([5, 3]), 0), ValueError,
     r"^num_sampled must be an integer >= 1, got 0"),
    ("similarity_clusters: a negative size", call(similarity_clusters, np.zeros((2, 2)), np.array([5, -3]), 1),
     ValueError, r"^sizes holds -3"),
    ("highest_similarity_partners: nan", call(A.highest_similarity_partners, jnp.full((3, 3), jnp.nan)), ValueError,
     r"^similarity\[0, 1\] is nan; partners are chosen by comparing similarities"),
    ("lowest_similarity_partners: inf", call(A.lowest_similarity_partners, jnp.eye(3).at[2, 0].set(jnp.inf)),
     ValueError, r"^similarity\[2, 0\] is inf"),
    ("in_order_partners: round as text", call(A.in_order_partners, 4, "3"), ValueError,
     r"^round_idx must be an integer round index, got '3'"),
    ("in_order_partners: round -1", call(A.in_order_partners, 4, -1), ValueError,
     r"^round_idx is -1; a round index is >= 0"),
    ("dynamic_alpha: round -5", call(A.dynamic_alpha, -5), ValueError, r"^round_idx is -5; a round index is >= 0"),
    ("dynamic_alpha: round 1.5", call(A.dynamic_alpha, 1.5), ValueError, r"^round_idx must hold integers"),
]


@cases(SAMPLING)
def test_sampling_and_partner_functions_name_the_bad_argument(case):
  refused(case)


def test_a_nan_diagonal_is_not_compared_and_a_traced_similarity_is_not_checked():
  sim = jnp.array([[jnp.nan, 0.5, 0.1], [0.5, jnp.nan, 0.2], [0.1, 0.2, jnp.nan]])
  assert A.highest_similarity_partners(sim).tolist() == [1, 0, 1]
  assert jax.jit(A.highest_similarity_partners)(sim).tolist() == [1, 0, 1]


PRIVATE = PrivacyConfig(clip=1.0, noise_multiplier=1.0)
DELTA = {"w": jnp.array([3.0, 4.0])}
SERVER = [
    ("epsilon: 10 per round of 4 clients", call(epsilon, PRIVATE, 10, 4, 5), ValueError,
     r"^clients_per_round 10 exceeds num_clients 4"),
    ("epsilon: 0 clients per round", call(epsilon, PRIVATE, 0, 4, 5), ValueError,
     r"^clients_per_round must be an integer >= 1, got 0"),
    ("epsilon: negative rounds", call(epsilon, PRIVATE, 2, 4, -1), ValueError, r"^rounds must be an integer >= 0"),
    ("scale_by_adaptive_moments: unknown kind", call(scale_by_adaptive_moments, "sgd", 0.9, 0.99, 1e-3), ValueError,
     r"^kind must be one of adagrad, yogi, adam, got 'sgd'"),
    ("scale_by_adaptive_moments: beta1 1.5", call(scale_by_adaptive_moments, "adam", 1.5, 0.99, 1e-3), ValueError,
     r"^beta1 must be a finite number in \[0, 1\), got 1.5"),
    ("scale_by_adaptive_moments: beta2 1", call(scale_by_adaptive_moments, "yogi", 0.9, 1.0, 1e-3), ValueError,
     r"^beta2 must be a finite number in \[0, 1\), got 1.0"),
    ("scale_by_adaptive_moments: tau 0", call(scale_by_adaptive_moments, "adam", 0.9, 0.99, 0.0), ValueError,
     r"^tau must be a finite number > 0, got 0.0"),
    ("clipped: negative clip", call(clipped, DELTA, -1.0), ValueError, r"^clip must be a finite number > 0, got -1.0"),
    ("clipped: nan clip", call(clipped, DELTA, float("nan")), ValueError,
     r"^clip must be a finite number > 0, got nan"),
    ("clipped: numpy zero clip", call(clipped, DELTA, np.float32(0)), ValueError, r"^clip must be a finite number > 0"),
    ("clip_term: negative clip", call(clip_term, -2.0), ValueError, r"^clip must be a finite number > 0, got -2.0"),
]


@cases(SERVER)
def test_privacy_and_server_optimizer_functions_name_the_bad_argument(case):
  refused(case)


def test_a_traced_clip_and_beta_stay_unchecked_under_jit():
  """A swept setting reaches these functions traced: the checks read concrete values only."""
  out = jax.jit(clipped)(DELTA, jnp.float32(1.0))
  np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-6)
  step = jax.jit(lambda beta1, g: scale_by_adaptive_moments("adam", beta1, 0.99, 1e-3).update(
      g, scale_by_adaptive_moments("adam", 0.9, 0.99, 1e-3).init(g))[0])
  assert np.isfinite(np.asarray(step(jnp.float32(0.9), DELTA)["w"])).all()


CONFIG = [
    ("from_dict: unknown nested key", call(from_dict, {"server": {"lrr": 1}}), ValueError,
     r"^from_dict: unknown setting 'server.lrr'; server takes optimizer, lr"),
    ("from_dict: unknown top-level key", call(from_dict, {"round": 3}), ValueError,
     r"^from_dict: unknown setting 'round'; the top level takes data, groups"),
    ("from_dict: a section that is no dict", call(from_dict, {"server": 5}), ValueError,
     r"^from_dict: 'server' must be a dict of its settings, got 5"),
    ("from_dict: no dict at all", call(from_dict, [("server", {})]), TypeError, r"^from_dict takes a dict of settings"),
    ("register_method: build not callable", call(register_method, "EdgeNotCallable", 42), TypeError,
     r"^register_method\('EdgeNotCallable'\): build must be a function .* got 42"),
    ("register_method: name not text", call(register_method, 7, lambda: None), TypeError,
     r"^register_method's name must be a non-empty string, got 7"),
    ("register_method: build takes other arguments than options gives",  # (it failed as the run built it)
     call(register_method, "EdgeSignature", lambda: None, options=(LocalConfig,)), TypeError,
     r"^register_method\('EdgeSignature'\): build\(\) must accept one positional argument per option family in "
     r"options \(LocalConfig\), as a run calls it: too many positional arguments"),
]


@cases(CONFIG)
def test_config_and_registry_functions_name_the_bad_argument(case):
  refused(case)


def test_from_dict_still_skips_unknown_names_into_ignored_and_round_trips():
  ignored: list[str] = []
  config = from_dict({"server": {"lrr": 1}, "extra": 2}, ignored)
  assert config == RunConfig() and sorted(ignored) == ["extra", "server.lrr"]
  assert from_dict(as_dict(RunConfig.from_flags(rounds=7))) == RunConfig.from_flags(rounds=7)


def test_an_evaluation_variables_hook_that_returns_another_tree_is_named():
  method = Method("EdgeEval", "", "t", sharing=PER_GROUP, evaluation_variables=lambda model, variables, store: {
      "params": {}})
  sim = tiny_simulation(method)
  with pytest.raises(ValueError, match=r"^the evaluation_variables of method 'EdgeEval' returned variables of "
                                       r"another tree .*; it must keep the variables' tree, shapes and dtypes"):
    sim.evaluate(sim.init_state())

"""XLA:CPU's kernel choice (`compilation.use_cpu_fusions`), the compile counter, the bounded program caches, and
Python's full garbage collections deferred while a run sets up and trains (`garbage`)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import compilation, garbage
from fedjax_hetero.garbage import deferred_full_collections
from fedjax_hetero.models import build_model
from tests.helpers import tiny_resnet, tiny_simulation

FLAG = "--xla_cpu_experimental_ynn_fusion_type"


@pytest.fixture
def fresh_process(monkeypatch):
  """`use_cpu_fusions` as if jax had not computed yet, with no fusion settings in the environment."""
  monkeypatch.setattr(compilation.xla_bridge, "backends_are_initialized", lambda: False)
  monkeypatch.delenv(compilation.CPU_FUSIONS_ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def test_default_fusions_are_added_to_xla_flags(fresh_process):
  assert compilation.use_cpu_fusions() == compilation.DEFAULT_CPU_FUSIONS
  assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=1 {FLAG}=dot,reduce"


def test_fusions_from_the_environment_or_off(fresh_process, monkeypatch):
  monkeypatch.setenv(compilation.CPU_FUSIONS_ENV, "dot")
  assert compilation.use_cpu_fusions() == "dot"
  assert os.environ["XLA_FLAGS"].endswith(f"{FLAG}=dot")
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv(compilation.CPU_FUSIONS_ENV, "off")
  assert compilation.use_cpu_fusions() is None
  assert FLAG not in os.environ["XLA_FLAGS"]


def test_a_users_xla_flag_is_kept(fresh_process, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=dot,eltwise")
  assert compilation.use_cpu_fusions("reduce") == "dot,eltwise"
  assert os.environ["XLA_FLAGS"] == f"{FLAG}=dot,eltwise"


def test_nothing_changes_once_jax_has_computed(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.delenv(compilation.CPU_FUSIONS_ENV, raising=False)
  jnp.zeros(1).block_until_ready()
  assert compilation.use_cpu_fusions() is None
  assert os.environ["XLA_FLAGS"] == ""


_CONV_GRADIENT = """
import json, os
import fedjax_hetero, jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(32, 14, 14, 32)), jnp.float32)
w = jnp.asarray(rng.normal(size=(3, 3, 32, 64)) * 0.1, jnp.float32)
v = jnp.asarray(rng.normal(size=(6272, 16)) * 0.01, jnp.float32)
conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
loss = lambda x, w: (jax.nn.relu(conv(x, w)) ** 2).mean() + jnp.tanh(x.reshape(32, -1) @ v).sum()
gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""),
                  "gx": np.asarray(gx).ravel()[::97].tolist(), "gw": np.asarray(gw).ravel()[::31].tolist()}))
"""


def _conv_gradient(fusions: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env[compilation.CPU_FUSIONS_ENV] = fusions
  out = subprocess.run([sys.executable, "-c", _CONV_GRADIENT], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the fusions are an XLA:CPU option")
def test_library_kernels_agree_with_xlas_own_within_float_tolerance():
  fused, plain = _conv_gradient("dot,reduce"), _conv_gradient("off")
  assert f"{FLAG}=dot,reduce" in fused["flags"] and FLAG not in plain["flags"]
  for name in ("gx", "gw"):
    np.testing.assert_allclose(fused[name], plain[name], rtol=1e-4, atol=1e-6)


@compilation.program_cache
def _scaled_sum(scale: float):
  return jax.jit(lambda x: (scale * x).sum())


def test_program_cache_shares_equal_builds_and_keeps_a_bounded_number():
  assert _scaled_sum(2.0) is _scaled_sum(2.0)
  for i in range(compilation.PROGRAM_CACHE_SIZE + 5):
    _scaled_sum(float(i))
  assert _scaled_sum.cache_info().currsize == compilation.PROGRAM_CACHE_SIZE
  compilation.release_programs()
  assert _scaled_sum.cache_info().currsize == 0


def test_program_cache_builds_anew_for_arguments_it_cannot_hash():
  compilation.release_programs()
  unhashable = [3.0]
  assert _scaled_sum(unhashable) is not _scaled_sum(unhashable)
  assert _scaled_sum.cache_info().currsize == 0


@pytest.mark.skipif(compilation.memory_mappings() is None, reason="needs Linux's /proc")
def test_released_programs_give_their_memory_mappings_back():
  compilation.release_programs()
  before, _ = compilation.memory_mappings()
  x = jnp.ones(7)
  for i in range(20):  # 20 distinct executables
    float(_scaled_sum(float(i) + 0.5)(x))
  held, _ = compilation.memory_mappings()
  compilation.release_programs()
  after, _ = compilation.memory_mappings()
  assert held - before >= 20, (before, held)
  assert after - before < (held - before) / 2, (before, held, after)


def test_mapping_headroom_releases_programs_then_names_the_limit(monkeypatch):
  released = []
  monkeypatch.setattr(compilation, "release_programs", lambda: released.append(True))
  monkeypatch.setattr(compilation, "memory_mappings", lambda: (100, 1000))
  compilation.mapping_headroom()
  assert not released
  counts = iter([(700, 1000), (500, 1000)])
  monkeypatch.setattr(compilation, "memory_mappings", lambda: next(counts))
  with pytest.warns(RuntimeWarning, match="700 of its 1,000 memory mappings"):
    compilation.mapping_headroom()
  assert released == [True]
  counts = iter([(950, 1000), (940, 1000)])
  with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"vm.max_map_count.*release_programs"):
    compilation.mapping_headroom()


# Small widths and depths of the zoo's layer kinds (dense, convolution, BatchNorm and residual stages, LayerNorm and
# attention); the golden record holds the programs of a whole run, initialization included, to the bit on the CPU
# that made it. (The program's size, which the default level's compile time follows, grows with depth.)
_INIT_MODELS = {"cnn": lambda: build_model("cnn", 10, 0.5), "mlp": lambda: build_model("mlp", 10, 0.5),
                "resnet": lambda: tiny_resnet((1, 1), num_classes=10), "vit": lambda: build_model("vit_d1", 10, 0.25)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_INIT_MODELS))
def test_a_light_program_initializes_every_model_to_the_same_bits_as_jit(name):
  """What `light_jit`'s lower optimization level may compile: a model's initialization (random draws, its first
  forward pass) gives the bits `jax.jit` gives, so the golden record's first model is unchanged."""
  model = _INIT_MODELS[name]()
  key, sample = jax.random.key(3), jnp.zeros((1, 28, 28, 1), jnp.float32)
  # Against XLA's default level (3), which the suite's own level 0 (tests/conftest.py) would replace in a plain jit.
  want = jax.jit(model.init, compiler_options={"xla_backend_optimization_level": 3})(key, sample)
  have = compilation.light_jit(model.init)(key, sample)
  assert jax.tree.structure(want) == jax.tree.structure(have)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(have)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_light_program_inside_a_trace_is_a_plain_jit():
  """jax allows compiler options on the outermost program only: traced inside another, a light program
  becomes part of it."""
  double = compilation.light_jit(lambda x: 2 * x)
  assert float(double(jnp.float32(2))) == 4.0
  assert float(jax.jit(lambda x: double(x) + 1)(jnp.float32(2))) == 5.0
  assert float(jax.grad(lambda x: double(x))(jnp.float32(1))) == 2.0


def test_a_light_program_compiled_beside_is_not_compiled_again_by_its_call():
  """`light_jit.compile_beside` compiles on a thread while the caller goes on; the next call waits for it and
  finds the program in jit's cache (the initialization compiles while a spec is built)."""
  model = build_model("cnn", 10, 0.25)
  key, sample = jax.random.key(0), jnp.zeros((1, 28, 28, 1), jnp.float32)
  init = compilation.light_jit(model.init)
  with compilation.CompileLog() as log:
    init.compile_beside(key, sample)
    variables = init(key, sample)
  assert log.count == 1, log.names  # the thread's
  with compilation.CompileLog() as log:  # called with such arguments: nothing to compile
    init.compile_beside(key, sample)
    init(key, sample)
  assert log.count == 0, log.names
  want = compilation.light_jit(model.init)(key, sample)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_light_program_called_with_host_arrays_inside_a_trace_is_traced_in():
  """No argument is a tracer, but the call is inside `jax.eval_shape` (a spec's state shapes trace the
  initialization with a host seed and sample): the plain program, which a trace can inline."""
  double = compilation.light_jit(lambda x: 2 * x)
  assert jax.eval_shape(lambda: double(np.float32(2))).shape == ()
  assert float(double(np.float32(2))) == 4.0


def test_a_runs_setup_compiles_only_the_initialization(tmp_path):
  """Data placed with `jax.device_put`, the init's key made inside its program, shapes traced from inside: on an
  accelerator every eager operation of the setup compiles a program of its own."""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.data import synthetic_dataset
  from fedjax_hetero.run import runner
  # (shapes no other test places, so that no program is in jit's cache already)
  dataset = synthetic_dataset(num_train=91, num_test=37, image_shape=(9, 7, 1), num_classes=3, seed=3)
  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=5,
                                clients_per_round=2, rounds=1, progress=False, output_dir=str(tmp_path / "run"))
  with compilation.CompileLog() as log:
    run = runner.prepare(config, dataset, lambda _: None, runner.run_method(config))
    jax.block_until_ready(run.state)
    run.partition.result()
  assert log.names == ["jit(initialize)"], log.names


def test_a_host_loops_stand_in_for_an_empty_group_compiles_nothing():
  """A group none of whose clients was sampled gets zeros made on the host and placed: made by jax operations,
  every leaf's shape compiled a program of its own (on an accelerator, a compilation each)."""
  sim = tiny_simulation("HeteroAvg", widths=(1.0, 0.5), hidden=(13,))  # (shapes no other test compiles)
  spec, state = sim.spec, sim.init_state()
  start, share = spec.start_variables(state, 1), spec.group_share(state, 1)
  with compilation.CompileLog() as log:
    empty = sim.cohorts._empty_result(spec, 1, start, share, state)
    jax.block_until_ready(empty)
  assert log.names == [], log.names
  assert jax.tree.structure(empty.delta_sum) == jax.tree.structure(start)
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(empty))


def test_counting_correct_predictions_compiles_only_its_batch_programs():
  """The batches' counts are summed on the host: summed by jax operations, an evaluation compiled programs of its
  own besides the batches' (on an accelerator, a compilation each)."""
  from fedjax_hetero.models.evaluation import correct_predictions
  model = build_model("mlp", 3, 1.0)
  images = jnp.asarray(np.random.default_rng(0).random((10, 4, 4, 1), np.float32))
  labels = jnp.asarray(np.arange(10) % 3, jnp.int32)
  variables = model.init(jax.random.key(0), images[:1])
  jax.clear_caches()  # (the scalar sums' programs may be cached by an earlier test)
  with compilation.CompileLog() as log:
    count = correct_predictions(model, variables, images, labels, (0.0,), (1.0,), batch_size=4)
  assert log.names == ["jit(<lambda>)", "jit(<lambda>)"], log.names  # two full batches' program, the remainder's
  want = int(np.sum(np.argmax(model.apply(variables, images), -1) == labels))
  assert count == want


def test_chunk_programs_compile_per_shape_and_keep_the_newest():
  """Executables are kept per shape of the data and the cohort (a second simulation of one structure with other
  shapes compiles its own), the `CHUNK_SHAPES_KEPT` newest of them."""
  from fedjax_hetero.compilation import CHUNK_SHAPES_KEPT, ChunkPrograms
  chunks = ChunkPrograms(jax.jit(lambda s, images, labels, ids, mask, offset, n: s + n * images.sum() + offset,
                                 static_argnums=6), (1, 2))
  for size in range(1, CHUNK_SHAPES_KEPT + 3):
    images = np.ones((size, 2), np.float32)
    args = (images, np.zeros(size, np.int32), np.zeros((3, 2), np.int32), np.ones((3, 2), bool))
    assert not chunks.compiled_for(*args)
    assert float(chunks(np.float32(1), *args, 5, 2)) == 1 + 2 * 2 * size + 5
    assert chunks.compiled_for(*args)
  assert len(chunks._compiled) == CHUNK_SHAPES_KEPT


# ------------------------------------------------------------------------------ full collections deferred


@pytest.fixture
def thresholds():
  """The process's collector thresholds, set to CPython's defaults for the test and restored after it."""
  before = gc.get_threshold()
  gc.set_threshold(700, 10, 10)
  if gc.get_threshold() != (700, 10, 10):  # (a collector without these generations: the deferral does nothing)
    read_back = gc.get_threshold()
    gc.set_threshold(*before)
    pytest.skip(f"this Python's gc reads its thresholds back as {read_back}")
  yield
  gc.set_threshold(*before)


def test_full_collections_are_deferred_within_nested_and_overlapping_blocks(thresholds):
  inner_entered, outer_may_end = threading.Event(), threading.Event()

  def other_thread():  # enters while the main thread's block is open, ends after it
    with deferred_full_collections():
      inner_entered.set()
      outer_may_end.wait(10)
      seen.append(gc.get_threshold())

  seen = []
  with deferred_full_collections():
    assert gc.get_threshold() == (700, 10, garbage.FULL_COLLECTION_EVERY)
    with deferred_full_collections(every=50):  # (nested: the outer block's setting holds)
      assert gc.get_threshold() == (700, 10, garbage.FULL_COLLECTION_EVERY)
    thread = threading.Thread(target=other_thread)
    thread.start()
    inner_entered.wait(10)
  assert gc.get_threshold() == (700, 10, garbage.FULL_COLLECTION_EVERY)  # the thread's block is still open
  outer_may_end.set()
  thread.join(10)
  assert seen == [(700, 10, garbage.FULL_COLLECTION_EVERY)]
  assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_are_restored_after_an_error_and_a_larger_one_is_kept(thresholds):
  gc.set_threshold(500, 20, 5000)
  with pytest.raises(KeyError), deferred_full_collections():
    assert gc.get_threshold() == (500, 20, 5000)
    raise KeyError
  assert gc.get_threshold() == (500, 20, 5000)
  gc.set_threshold(500, 20, 3)
  with deferred_full_collections():
    assert gc.get_threshold() == (500, 20, garbage.FULL_COLLECTION_EVERY)
  assert gc.get_threshold() == (500, 20, 3)


def test_a_run_and_a_job_set_up_and_train_with_full_collections_deferred(thresholds, monkeypatch, tmp_path):
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run import jobs, runner

  class Seen(Exception):
    pass

  def record(*_, **__):
    raise Seen(gc.get_threshold())

  monkeypatch.setattr(runner, "prepare", record)
  monkeypatch.setattr(runner, "plan", record)
  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp",), rounds=1, output_dir=str(tmp_path / "run"))
  with pytest.raises(Seen) as alone:
    runner.run_checked(config, runner.run_method(config))
  with pytest.raises(Seen) as together:
    jobs.run_together(jobs.runs_of(config, [0, 1]), log=lambda _: None)
  assert alone.value.args[0] == together.value.args[0] == (700, 10, garbage.FULL_COLLECTION_EVERY)
  assert gc.get_threshold() == (700, 10, 10)


def test_a_simulations_calls_defer_full_collections(thresholds, monkeypatch):
  sim, seen = tiny_simulation("HeteroAvg"), []
  plan = type(sim)._plan
  monkeypatch.setattr(type(sim), "_plan", lambda *args: seen.append(gc.get_threshold()) or plan(*args))
  sim.run_rounds(sim.init_state(), 2)
  assert seen == [(700, 10, garbage.FULL_COLLECTION_EVERY)] * 2
  assert gc.get_threshold() == (700, 10, 10)

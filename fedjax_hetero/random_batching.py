"""A function's independent random draws made together, one draw per kind: the same values from a smaller program.

A flax model's initialization gives every parameter a key of its own (the init key with the parameter's path
folded in) and draws the parameter's bits from it. Each fold-in and each draw is an instance of jax's threefry
hash, which the compiler builds one by one: a ResNet26's initialization holds about ninety fold-ins and thirty
draws, and as jax lowers it for a GPU 87% of its ops are the hash's unrolled rounds (``python -m
benchmarks.program_size --lowered-for cuda``). `batch_random_draws` traces a function and evaluates its program
with the draws that are ready at the same time and alike (one primitive, its parameters, its operands' types)
made as one draw over their stacked operands. Under `jax.vmap` a threefry key (jax's default) draws what it draws
alone, so the values are the same bits; draws from other kinds of key are made one by one, as before
(tests/test_random_batching.py compares every model family's initialization with ``model.init``'s).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.extend import core as jex

BATCHED_PRIMITIVES = ("random_fold_in", "random_bits")
_INLINED = ("jit", "pjit")  # (jax's name for a nested jitted call, then and now)


class _Slot:
  """One value of the flattened program (a nested call's variables are renamed apart: jax reuses a cached
  function's jaxpr, and so its variables, at every call)."""

  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval


class _Eqn:
  __slots__ = ("eqn", "ins", "outs")

  def __init__(self, eqn, ins, outs):
    self.eqn, self.ins, self.outs = eqn, ins, outs

  def signature(self) -> tuple[Any, ...]:
    return (self.eqn.primitive, tuple(sorted(self.eqn.params.items())), tuple(v.aval for v in self.ins))


def _flatten(closed: jex.ClosedJaxpr) -> tuple[list[_Slot], list[_Eqn], list[Any], dict[_Slot, Any]]:
  """(inputs, equations, outputs, constants) of ``closed`` with every nested jitted call inlined."""
  eqns: list[_Eqn] = []
  consts: dict[_Slot, Any] = {}

  def inline(jaxpr: jex.Jaxpr, jaxpr_consts, args) -> list[Any]:
    names = dict(zip(jaxpr.invars, args))
    for var, value in zip(jaxpr.constvars, jaxpr_consts):
      names[var] = slot = _Slot(var.aval)
      consts[slot] = value
    read = lambda v: v if isinstance(v, jex.Literal) else names[v]  # noqa: E731
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      if eqn.primitive.name in _INLINED:
        outs = inline(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, ins)
      else:
        outs = [_Slot(v.aval) for v in eqn.outvars]
        eqns.append(_Eqn(eqn, ins, outs))
      names.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  inputs = [_Slot(v.aval) for v in closed.jaxpr.invars]
  return inputs, eqns, inline(closed.jaxpr, closed.consts, inputs), consts


def _needed(eqns: list[_Eqn], outputs: list[Any]) -> list[_Eqn]:
  """The equations the outputs depend on (and any with an effect), in order."""
  live = {id(v) for v in outputs}
  kept = []
  for e in reversed(eqns):
    if e.eqn.effects or any(id(v) in live for v in e.outs):
      kept.append(e)
      live.update(id(v) for v in e.ins)
  return kept[::-1]


def _bind(eqn, args, **changed):
  bound = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = bound if isinstance(bound, tuple) else ((), bound)  # (older jax returned both)
  ctx = getattr(eqn, "ctx", None)
  with ctx.manager if ctx is not None else contextlib.nullcontext():
    return eqn.primitive.bind(*subfuns, *args, **{**params, **changed})


def _threefry(key) -> bool:
  """Whether ``key`` draws with jax's threefry hash, which under `jax.vmap` gives each key its own values (the
  "rbg" keys do not: their batched draws differ)."""
  return str(jax.random.key_impl(key)) == "threefry2x32"


def _cut_from_longer(e: _Eqn) -> bool:
  """Whether ``e`` draws bits that can be cut from a longer draw (`_cut`): traced under threefry's partitionable
  form (its own context's setting, else jax's)."""
  partitionable = getattr(getattr(e.eqn, "ctx", None), "threefry_partitionable", jax.config.jax_threefry_partitionable)
  return e.eqn.primitive.name == "random_bits" and partitionable


def _kind(e: _Eqn) -> tuple[Any, ...]:
  """Draws of one kind are made together: bits of any shape where they are cut from a longer draw (`_cut`),
  other draws alike in every respect."""
  if _cut_from_longer(e):
    return (e.eqn.primitive, e.eqn.params["bit_width"], e.ins[0].aval)
  return e.signature()


def _batched(e: _Eqn, read) -> bool:
  """Whether ``e`` is a draw made together with its kind: from one threefry key (a batch of keys is left alone)."""
  return (e.eqn.primitive.name in BATCHED_PRIMITIVES and not e.ins[0].aval.shape
          and _threefry(read(e.ins[0])))


def _cut(draws: list[_Eqn], waste: float = 1.25) -> list[list[_Eqn]]:
  """Bit draws in groups, each cut from one longer draw per key, largest first, none computing more than
  ``waste`` times the bits its members use. Threefry in its partitionable form (jax's default since 0.5) hashes
  each element's flat index, so a draw's n bits are the first n of any longer draw from its key."""
  groups: list[list[_Eqn]] = []
  used = 0
  for d in sorted(draws, key=lambda d: -d.outs[0].aval.size):
    size = d.outs[0].aval.size
    if groups and (len(groups[-1]) + 1) * groups[-1][0].outs[0].aval.size <= waste * (used + size):
      groups[-1].append(d)
      used += size
    else:
      groups.append([d])
      used = size
  return groups


def _together(alike: list[_Eqn], read) -> Iterator[tuple[_Slot, Any]]:
  """The values of draws of one kind, made as one vmapped draw (bits: one per `_cut` group)."""
  first = alike[0].eqn
  if _cut_from_longer(alike[0]):
    for group in _cut(alike):
      size = group[0].outs[0].aval.size
      bits = jax.vmap(lambda key: _bind(first, [key], shape=(size,)))(jnp.stack([read(d.ins[0]) for d in group]))
      yield from ((d.outs[0], bits[n, :d.outs[0].aval.size].reshape(d.outs[0].aval.shape))
                  for n, d in enumerate(group))
  else:
    stacked = [jnp.stack([read(d.ins[k]) for d in alike]) for k in range(len(first.invars))]
    made = jax.vmap(lambda *operands: _bind(first, operands))(*stacked)
    yield from ((d.outs[0], made[n]) for n, d in enumerate(alike))


def batch_random_draws(fun: Callable[..., Any]) -> Callable[..., Any]:
  """``fun`` with the random draws that are ready together and alike made as one vmapped draw (module
  docstring): the same values, fewer hash instances for the compiler. Traceable: call it inside `jax.jit`."""

  @functools.wraps(fun)  # (the program keeps ``fun``'s name)
  def batched(*args):
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)  # (``fun``'s own errors raise here)
    leaves = jax.tree.leaves(args)
    try:  # (a trace of its own: where it fails, nothing of it is in the caller's trace)
      rewritten = jax.make_jaxpr(lambda *values: _evaluate(closed, list(values)))(*leaves)
    except Exception as error:  # noqa: BLE001 (jax internals of another version: the draws are made one by one)
      _warn_once(error)
      return fun(*args)
    return jax.tree.unflatten(jax.tree.structure(out_shape), jex.jaxpr_as_fun(rewritten)(*leaves))

  return batched


def _evaluate(closed: jex.ClosedJaxpr, args: list[Any]) -> list[Any]:
  """``closed``'s outputs for ``args``, its alike draws that are ready together made together."""
  inputs, eqns, outputs, consts = _flatten(closed)
  eqns = _needed(eqns, outputs)
  env: dict[_Slot, Any] = {**consts, **dict(zip(inputs, args))}
  read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
  ready = lambda e: e.outs[0] not in env and all(isinstance(v, jex.Literal) or v in env for v in e.ins)  # noqa: E731
  kinds: dict[tuple[Any, ...], list[_Eqn]] = collections.defaultdict(list)
  for e in eqns:
    if e.eqn.primitive.name in BATCHED_PRIMITIVES:
      kinds[_kind(e)].append(e)
  for e in eqns:
    if e.outs and e.outs[0] in env:  # (made together with an earlier draw)
      continue
    alike = [d for d in kinds[_kind(e)] if ready(d) and _batched(d, read)] if _batched(e, read) else []
    if len(alike) > 1:
      env.update(_together(alike, read))
    else:
      made = _bind(e.eqn, [read(v) for v in e.ins])
      env.update(zip(e.outs, made if e.eqn.primitive.multiple_results else [made]))
  return [read(v) for v in outputs]


_warned: list[str] = []  # (once a process)


def _warn_once(error: Exception) -> None:
  if not _warned:
    _warned.append(f"{type(error).__name__}: {error}")
    warnings.warn(f"fedjax_hetero.random_batching: this jax's programs could not be re-evaluated ({_warned[0]}); "
                  "the random draws are made one by one (the same values, a larger program)", RuntimeWarning,
                  stacklevel=3)

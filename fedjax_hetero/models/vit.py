"""A small Vision Transformer in the layout of timm's ViT (InCo's ViT-S, spec inco.md §2.2).

Patch embedding, a CLS token and learned position embeddings, `depth`
pre-norm blocks (LayerNorm-attention and LayerNorm-MLP residual branches, qkv
bias, exact GELU, LayerNorm eps 1e-6), a final LayerNorm and CLS pooling.
The defaults are far smaller than ViT-S (patch 4, embed 64, 4 heads, depth 6)
so that the model runs on CPU and on 28x28 or 32x32 inputs (49 or 64 patches).

Blocks are named `block1..blockN`, so a depth-d ViT's variables are those of
a depth-D one without blocks d+1..D (InCo's layer splitting keeps the first
blocks). `width` scales the per-head size and the MLP hidden size; the number
of heads is fixed, so every kernel of a narrower ViT (query/key/value kernels
are [embed, heads, head_dim]) is a leading slice of the wider one's. Unlike
the conv nets, a narrow ViT is not the wide one with zeroed weights: the
LayerNorm statistics and the attention scale 1/sqrt(head_dim) depend on the
width.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.models.common import Part, lax_convolution, run_parts, scale_channels
from fedjax_hetero.models.resnet import dense_init

Array = jax.Array
Path = tuple[str, ...]

# timm's ViT init: trunc_normal(std=0.02) for Linear weights and the position embedding.
trunc_init = nn.initializers.truncated_normal(0.02)
LN_EPS = 1e-6


class FeedForward(nn.Module):
  """Dense-GELU-Dense; GELU is exact, as in timm (flax's default is the tanh approximation)."""

  hidden: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    h = nn.gelu(nn.Dense(self.hidden, kernel_init=trunc_init, dtype=self.dtype, name="fc1")(x), approximate=False)
    return nn.Dense(x.shape[-1], kernel_init=trunc_init, dtype=self.dtype, name="fc2")(h)


class EncoderBlock(nn.Module):
  """x + attn(norm1(x)), then x + mlp(norm2(x))."""

  num_heads: int
  mlp_hidden: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    embed = x.shape[-1]
    y = nn.LayerNorm(LN_EPS, dtype=self.dtype, name="norm1")(x)
    y = nn.MultiHeadDotProductAttention(self.num_heads, dtype=self.dtype, qkv_features=embed, out_features=embed,
                                        kernel_init=trunc_init, deterministic=True, name="attn")(y)
    x = x + y
    y = nn.LayerNorm(LN_EPS, dtype=self.dtype, name="norm2")(x)
    return x + FeedForward(self.mlp_hidden, self.dtype, name="mlp")(y)


class ViT(nn.Module):
  """ViT with cut points input, embed, block1..blockN, features, logits.

  Attributes:
    num_classes: logits size (never scaled by `width`).
    width: multiplier of the per-head size (so of the embedding) and of the MLP hidden size.
    patch_size: side of the square, non-overlapping patches (trailing pixels that do not fill a patch are dropped).
    embed_dim: embedding size at width 1; must be divisible by `num_heads`.
    depth: number of transformer blocks.
    num_heads: attention heads (not scaled by `width`).
    mlp_ratio: MLP hidden size over the embedding size.
    dtype: computation dtype; parameters stay float32 and logits are returned in float32.

  The position embedding's shape follows the number of patches, so a model
  initialised on 28x28 inputs cannot be applied to 32x32 ones.
  """

  num_classes: int = 10
  width: float = 1.0
  patch_size: int = 4
  embed_dim: int = 64
  depth: int = 6
  num_heads: int = 4
  mlp_ratio: float = 4.0
  dtype: Any = jnp.float32

  @property
  def cut_points(self) -> tuple[str, ...]:
    return ("input", "embed") + tuple(f"block{i + 1}" for i in range(self.depth)) + ("features", "logits")

  @property
  def decoupling_cut(self) -> str:
    """FedImpro's default low/high split (`models.resolve_cut`): after the middle block."""
    return f"block{self.depth // 2}" if self.depth >= 2 else "embed"

  @nn.nowrap
  def cross_layer_pairs(self) -> tuple[tuple[Path, Path], ...]:
    """InCo's (target, source) 'params' paths: every block's norm2 scale takes its own norm1 scale.

    As in the authors' code (spec inco.md §1.3): a within-block pairing of the
    two LayerNorm scale vectors; biases, attention and MLP weights are left out.
    """
    return tuple((("params", f"block{i + 1}", "norm2", "scale"), ("params", f"block{i + 1}", "norm1", "scale"))
                 for i in range(self.depth))

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    del train, mask  # no BN or dropout
    if self.embed_dim % self.num_heads:
      raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
    embed = self.num_heads * scale_channels(self.embed_dim // self.num_heads, self.width)
    mlp_hidden = scale_channels(int(round(self.embed_dim * self.mlp_ratio)), self.width)

    def embedding(h: Array) -> Array:
      p = self.patch_size
      h = nn.Conv(embed, (p, p), (p, p), padding="VALID", kernel_init=dense_init, dtype=self.dtype,
                  conv_general_dilated=lax_convolution, name="patch_embed")(h)
      h = h.reshape(h.shape[0], -1, embed)
      cls = self.param("cls_token", nn.initializers.normal(1e-6), (1, 1, embed))
      h = jnp.concatenate([jnp.broadcast_to(cls, (h.shape[0], 1, embed)).astype(h.dtype), h], axis=1)
      return h + self.param("pos_embed", trunc_init, (1, h.shape[1], embed)).astype(h.dtype)

    def block(index: int, h: Array) -> Array:
      return EncoderBlock(self.num_heads, mlp_hidden, self.dtype, name=f"block{index + 1}")(h)

    def features(h: Array) -> Array:
      return nn.LayerNorm(LN_EPS, dtype=self.dtype, name="norm")(h)[:, 0]

    def head(h: Array) -> Array:
      return nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(h).astype(jnp.float32)

    parts: list[Part] = [("embed", embedding)]
    parts += [(f"block{i + 1}", functools.partial(block, i)) for i in range(self.depth)]
    parts += [("features", features), ("logits", head)]
    return run_parts(parts, x, start, stop)

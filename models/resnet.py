"""ResNet v1.5 for ImageNet classification (He et al. 2016), with cross-replica BatchNorm.

v1.5 differs from the paper's v1 only in the bottleneck block: the stride-2 downsampling
sits on the 3x3 conv rather than the first 1x1, which costs a little compute and buys
accuracy. The model knows nothing of meshes: every parameter carries logical axis names
from {"conv_h", "conv_w", "channels_in", "channels", "classes"} and feature maps carry
("batch", "height", "width", "channels") constraints; the trainer maps them to mesh axes.

BatchNorm running averages live in the "batch_stats" collection (plain float32 arrays,
no logical names: the trainer keeps them replicated). In training, batch statistics can be
averaged over the replicas of a mapped axis (`bn_axis_name`), optionally only within
groups of `bn_group_size` consecutive replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.layer_stack import remat_layer

Array = jax.Array
_ACT = ("batch", "height", "width", "channels")
_CONV_NAMES = ("conv_h", "conv_w", "channels_in", "channels")
_HE_NORMAL = nn.initializers.variance_scaling(2.0, "fan_out", "normal")

# Standard depths; use as ResNetConfig(**SIZES["resnet50"]). "tiny" is for tests.
SIZES: dict[str, dict[str, Any]] = {
    "resnet18": dict(stage_sizes=(2, 2, 2, 2), block="basic"),
    "resnet34": dict(stage_sizes=(3, 4, 6, 3), block="basic"),
    "resnet50": dict(stage_sizes=(3, 4, 6, 3), block="bottleneck"),
    "resnet101": dict(stage_sizes=(3, 4, 23, 3), block="bottleneck"),
    "resnet152": dict(stage_sizes=(3, 8, 36, 3), block="bottleneck"),
    "tiny": dict(stage_sizes=(1, 1), block="basic", width=8),
}


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Hyperparameters of the ResNet.

    Attributes:
      stage_sizes: residual blocks per stage; stage i (from 0) has width * 2^i channels
        (x4 at the output of bottleneck blocks) and all but the first halve the resolution.
      block: "bottleneck" (1x1, 3x3, 1x1; ResNet-50 and deeper) or "basic" (3x3, 3x3).
      num_classes: outputs of the final Dense layer.
      width: channels of the stem and of the first stage.
      dtype: compute dtype of convolutions and activations.
      param_dtype: dtype parameters are created in.
      bn_momentum: running average <- momentum * running average + (1 - momentum) * batch.
      bn_epsilon: added to the variance before the reciprocal square root.
      bn_axis_name: name of a mapped axis (e.g. the trainer's vmap over data replicas)
        whose replicas average their BatchNorm batch statistics in training; None keeps
        statistics per replica.
      bn_group_size: 0 averages over all replicas of `bn_axis_name`; G > 0 only within
        groups of G consecutive replicas (MLPerf's "BN span"). Must divide the axis size.
    """

    stage_sizes: tuple[int, ...]
    block: Literal["bottleneck", "basic"]
    num_classes: int = 1000
    width: int = 64
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_axis_name: str | None = None
    bn_group_size: int = 0
    remat: str = "none"


def _named(init: Any, *names: str) -> Any:
    return nn.with_logical_partitioning(init, names)


def _block_convs(block: str, features: int, strides: int) -> tuple[tuple[int, int, int], ...]:
    """(kernel size, stride, output channels) of each conv on a block's residual branch."""
    if block == "bottleneck":
        # v1.5: stride on the 3x3. A strided 1x1 (v1) would skip 3 of every 4 input pixels.
        return ((1, 1, features), (3, strides, features), (1, 1, 4 * features))
    if block == "basic":
        return ((3, strides, features), (3, 1, features))
    raise ValueError(f"unknown ResNet block {block!r}; expected 'bottleneck' or 'basic'")


def _blocks(config: ResNetConfig) -> Iterator[tuple[str, int, int]]:
    """(module name, base channels, stride) of every residual block, in order."""
    for i, num_blocks in enumerate(config.stage_sizes):
        for j in range(num_blocks):
            strides = 2 if i > 0 and j == 0 else 1
            yield f"stage{i + 1}_block{j + 1}", config.width * 2**i, strides


def replica_group_mean(x: Array, axis_name: str, group_size: int = 0) -> Array:
    """Mean of `x` over the replicas of mapped axis `axis_name`, or within replica groups.

    Args:
      x: this replica's value.
      axis_name: a mapped axis (vmap, pmap or shard_map) bound where this is called.
      group_size: 0 for all replicas; G for groups of G consecutive replicas
        (replicas [0, G), [G, 2G), ...), G must divide the axis size.

    Returns:
      The mean over this replica's group, shaped and typed like `x`.
    """
    replicas = jax.lax.axis_size(axis_name)
    if group_size in (0, replicas):
        return jax.lax.pmean(x, axis_name)
    if group_size < 0 or replicas % group_size:
        raise ValueError(
            f"bn_group_size {group_size} does not divide the {replicas} replicas "
            f"of axis {axis_name!r}"
        )
    # `axis_index_groups` would say this directly, but vmap's collectives reject it
    # (NotImplementedError in JAX 0.10). Instead every replica writes x into its group's
    # row of a [groups, *x.shape] zero array, one psum adds the rows up (an all-reduce of
    # groups * x.size elements; x is a few channel vectors, so cheap), and every replica
    # reads back its own group's row. Zeros add exactly, so the sums equal grouped psums.
    group = jax.lax.axis_index(axis_name) // group_size
    onehot = jax.nn.one_hot(group, replicas // group_size, dtype=x.dtype)
    sums = jax.lax.psum(onehot.reshape(-1, *(1,) * x.ndim) * x, axis_name)
    return sums[group] / group_size


class BatchNorm(nn.Module):
    """BatchNorm over batch, height and width, with statistics in float32.

    train=True normalises with the batch statistics (synchronised over
    `config.bn_axis_name` if set) and updates the running averages (apply with
    mutable=["batch_stats"]); train=False normalises with the running averages, so each
    example's output depends on that example alone.
    """

    config: ResNetConfig
    zero_scale: bool = False  # Residual branches start as identity (Goyal et al. 2017).

    @nn.compact
    def __call__(self, x: Array, *, train: bool) -> Array:
        cfg = self.config
        shape = (x.shape[-1],)
        scale_init = nn.initializers.zeros if self.zero_scale else nn.initializers.ones
        scale = self.param("scale", _named(scale_init, "channels"), shape, cfg.param_dtype)
        bias = self.param("bias", _named(nn.initializers.zeros, "channels"), shape, cfg.param_dtype)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, shape, jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, shape, jnp.float32)
        x32 = x.astype(jnp.float32)
        if train:
            # E[x] and E[x^2] stacked, so synchronising them is one all-reduce. [2, C] f32
            moments = jnp.stack([x32.mean((0, 1, 2)), jnp.square(x32).mean((0, 1, 2))])
            if cfg.bn_axis_name is not None:
                moments = replica_group_mean(moments, cfg.bn_axis_name, cfg.bn_group_size)
            mean = moments[0]
            # Biased variance; the clamp absorbs rounding when var << mean^2.
            var = jnp.maximum(moments[1] - jnp.square(mean), 0.0)
            if not self.is_initializing():
                m = cfg.bn_momentum
                ra_mean.value = m * ra_mean.value + (1.0 - m) * mean
                ra_var.value = m * ra_var.value + (1.0 - m) * var
        else:
            mean, var = ra_mean.value, ra_var.value
        mul = scale.astype(jnp.float32) * jax.lax.rsqrt(var + cfg.bn_epsilon)
        return ((x32 - mean) * mul + bias.astype(jnp.float32)).astype(cfg.dtype)


def _conv(cfg: ResNetConfig, features: int, kernel: int, strides: int, name: str) -> nn.Conv:
    """Bias-free conv (BN follows) with symmetric k // 2 padding, so an even input halves
    exactly under stride 2. He-normal (fan_out) init, as for ReLU networks."""
    pad = kernel // 2
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding=((pad, pad), (pad, pad)),
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=_named(_HE_NORMAL, *_CONV_NAMES),
        name=name,
    )


class ResidualBlock(nn.Module):
    """relu(shortcut(x) + branch(x)): a basic or bottleneck block (see `_block_convs`).

    The shortcut is the identity, or a 1x1 conv + BN projection when the stride or the
    channel count changes. The branch's last BN scale starts at zero.
    """

    config: ResNetConfig
    features: int  # base channels; a bottleneck outputs 4x this
    strides: int

    @nn.compact
    def __call__(self, x: Array, train: bool) -> Array:
        cfg = self.config
        convs = _block_convs(cfg.block, self.features, self.strides)
        y = x
        for i, (kernel, strides, features) in enumerate(convs, start=1):
            y = _conv(cfg, features, kernel, strides, name=f"conv{i}")(y)
            last = i == len(convs)
            y = BatchNorm(cfg, zero_scale=last, name=f"bn{i}")(y, train=train)
            if not last:
                y = nn.with_logical_constraint(nn.relu(y), _ACT)
        shortcut = x
        if self.strides != 1 or x.shape[-1] != y.shape[-1]:
            shortcut = _conv(cfg, y.shape[-1], 1, self.strides, name="proj_conv")(x)
            shortcut = BatchNorm(cfg, name="proj_bn")(shortcut, train=train)
        return nn.with_logical_constraint(nn.relu(shortcut + y), _ACT)


class ResNet(nn.Module):
    """ResNet v1.5 classifier; see `ResNetConfig`."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, images: Array, *, train: bool) -> Array:
        """Float32 logits [batch, num_classes].

        Args:
          images: float [batch, height, width, 3], any float dtype (cast to config.dtype).
          train: normalise with batch statistics and update the running averages in
            "batch_stats" (apply with mutable=["batch_stats"]); else use the averages.
        """
        cfg = self.config
        x = nn.with_logical_constraint(images.astype(cfg.dtype), _ACT)
        # Stem: 7x7/2 conv + BN + ReLU + 3x3/2 max-pool; 224x224 -> 56x56.
        x = _conv(cfg, cfg.width, 7, 2, name="stem_conv")(x)
        x = nn.relu(BatchNorm(cfg, name="stem_bn")(x, train=train))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        x = nn.with_logical_constraint(x, _ACT)
        # `train` is passed positionally: a static argument of remat'd blocks.
        block = remat_layer(ResidualBlock, cfg.remat, static_argnums=(2,))
        for name, features, strides in _blocks(cfg):
            x = block(cfg, features, strides, name=name)(x, train)
        # Global average pool in float32. [batch, channels]
        pooled = x.astype(jnp.float32).mean((1, 2))
        pooled = nn.with_logical_constraint(pooled, ("batch", "channels"))
        channels = pooled.shape[-1]
        # Small head init (std 0.01): initial logits near zero, i.e. near-uniform softmax.
        kernel = self.param(
            "head_kernel",
            _named(nn.initializers.normal(0.01), "channels_in", "classes"),
            (channels, cfg.num_classes),
            cfg.param_dtype,
        )
        bias = self.param(
            "head_bias",
            _named(nn.initializers.zeros, "classes"),
            (cfg.num_classes,),
            cfg.param_dtype,
        )
        # dtype operands, float32 accumulation and result: logits are never rounded.
        logits = jnp.dot(
            pooled.astype(cfg.dtype), kernel.astype(cfg.dtype), preferred_element_type=jnp.float32
        )
        logits = logits + bias.astype(jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "classes"))


def _convs(config: ResNetConfig, image_size: int) -> Iterator[tuple[int, int, int, int]]:
    """(kernel, in channels, out channels, output height = width) of every conv, in order."""

    def out(size: int, kernel: int, strides: int) -> int:
        return (size + 2 * (kernel // 2) - kernel) // strides + 1

    size = out(image_size, 7, 2)
    yield 7, 3, config.width, size
    size = out(size, 3, 2)  # max-pool
    channels = config.width
    for _, features, block_strides in _blocks(config):
        block_in, block_size = channels, size
        for kernel, strides, features_out in _block_convs(config.block, features, block_strides):
            size = out(size, kernel, strides)
            yield kernel, channels, features_out, size
            channels = features_out
        if block_strides != 1 or block_in != channels:
            yield 1, block_in, channels, out(block_size, 1, block_strides)


def _final_channels(config: ResNetConfig) -> int:
    expansion = 4 if config.block == "bottleneck" else 1
    return expansion * config.width * 2 ** (len(config.stage_sizes) - 1)


def param_count(config: ResNetConfig) -> int:
    """Exact number of trainable parameters (BatchNorm running averages excluded).

    Every k x k conv from C_in to C_out channels has k^2 * C_in * C_out weights (no bias)
    and is followed by a BN with 2 * C_out (scale, bias); projection shortcuts included.
    The head adds C * num_classes + num_classes, C = the last stage's output channels.
    """
    # Weights do not depend on the image size; any size will do for walking the convs.
    convs = sum(k * k * c_in * c_out + 2 * c_out for k, c_in, c_out, _ in _convs(config, 224))
    return convs + (_final_channels(config) + 1) * config.num_classes


def train_flops_per_example(config: ResNetConfig, image_size: int) -> float:
    """Model FLOPs of one training step on one image_size x image_size example.

    A multiply-accumulate counts 2 FLOPs. Forward = sum over convs (projections included)
    of 2 * H_out * W_out * k^2 * C_in * C_out, plus the head's 2 * C * num_classes.
    Training = 3 x forward (the backward pass computes gradients of both inputs and
    weights, each as costly as the forward). BatchNorm, ReLU, pooling and residual adds
    are ignored. ResNet-50 at 224: 3 x 8.18 GFLOPs.
    """
    forward = sum(
        2 * s * s * k * k * c_in * c_out for k, c_in, c_out, s in _convs(config, image_size)
    )
    forward += 2 * _final_channels(config) * config.num_classes
    return 3.0 * forward

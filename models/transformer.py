"""Encoder-decoder Transformer for WMT translation (Vaswani et al. 2017), pre-LayerNorm.

The model knows nothing of meshes: every parameter carries logical axis names from
{"vocab", "embed", "mlp", "heads", "kv"} and key activations carry logical constraints from
{"batch", "length", "embed", "mlp", "heads", "kv", "vocab"}; the trainer maps them to mesh
axes. Token id 0 is padding and doubles as the decoder's BOS token. Decoding (greedy, beam
search) lives in `models/decode.py`, the key/value cache in `models/kv_cache.py`; position
embeddings, decoder inputs and attention masks of (packed) rows in `models/packed_sequences.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import layer_stack
from models.kv_cache import update_kv_cache
from models.layers import Embedding, LayerNorm, attention, named
from models.packed_sequences import attention_mask, shift_right, sinusoidal_embedding

Array = jax.Array
_EMBED_ACT = ("batch", "length", "embed")
_HEADS_ACT = ("batch", "length", "heads", "kv")

# The two standard sizes; use as TransformerConfig(vocab_size=V, **SIZES["big"]).
SIZES: dict[str, dict[str, int]] = {
    "base": dict(emb_dim=512, num_heads=8, qkv_dim=512, mlp_dim=2048),
    "big": dict(emb_dim=1024, num_heads=16, qkv_dim=1024, mlp_dim=4096),
}
for _size in SIZES.values():
    _size.update(num_encoder_layers=6, num_decoder_layers=6)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of the Transformer (defaults: "big").

    Position embeddings are computed from positions on the fly, so `max_len` only bounds
    the sequence lengths `__call__` accepts.
    """

    vocab_size: int
    share_embeddings: bool = True
    emb_dim: int = 1024
    num_heads: int = 16
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    qkv_dim: int = 1024
    mlp_dim: int = 4096
    max_len: int = 256
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    remat: str = "none"  # per-layer activation rematerialisation, see models/remat.py
    # One `nn.scan` over each stack of layers, parameters stored [layers, ...] (logical
    # axis "layers"), instead of one module per layer: the step then has one gradient,
    # one gather and one reduction per kind of weight rather than per layer, and
    # compiles once per stack. Checkpoints convert between the two layouts
    # (models/stacking.py: `encoder_layers_3/...` is `encoder_layers/...`[3]).
    scan_layers: bool = False
    # Layers per iteration of those scans (>= the stack's depth: no loop at all).
    scan_unroll: int = 1
    decode: bool = False


def _dense(cfg: TransformerConfig, features: int, names: tuple[str, str], name: str) -> nn.Dense:
    """Dense with bias in cfg.dtype; kernel named `names`, bias names[-1:]."""
    return nn.Dense(
        features,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=named(nn.initializers.xavier_uniform(), *names),
        bias_init=named(nn.initializers.zeros, names[-1]),
        name=name,
    )


class MultiHeadAttention(nn.Module):
    """Multi-head dot-product attention (no biases); `cache=True` for decoding steps."""

    config: TransformerConfig
    cache: bool = False

    @nn.compact
    def __call__(self, x_q: Array, x_kv: Array, mask: Array | None, *, train: bool) -> Array:
        cfg = self.config
        head_dim = cfg.qkv_dim // cfg.num_heads

        # Kernels are created at their true rank: DenseGeneral initialises a flattened 2-D
        # kernel, which breaks rank-3 logical sharding constraints under a mesh.
        def kernel(name: str, shape: tuple[int, ...], names: tuple[str, ...], fan_in: Any):
            fan_out = tuple(i for i in range(3) if i not in fan_in)
            init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", fan_in, fan_out)
            w = self.param(name, named(init, *names), shape, cfg.param_dtype)
            return w.astype(cfg.dtype)

        # [heads, head_dim, embed], the contracted embed dim minor, like the output
        # projection's: the TPU compiler lays these weights (and their gradients) out
        # embed-minor whatever their logical order, and with embed last that is the
        # row-major layout, so the gradient's reduce-scatter over heads x head_dim
        # (a stack's layers first) is a true one. With embed first it ran as an
        # all-reduce of the stacked gradients (libtpu 0.0.42.1, v3:32x32).
        proj = ((cfg.num_heads, head_dim, cfg.emb_dim), ("heads", "kv", "embed"), (2,))
        q, k, v = (
            jnp.einsum("ble,hde->blhd", x, kernel(n, *proj))
            for n, x in (("query", x_q), ("key", x_kv), ("value", x_kv))
        )
        # [batch, length, heads, head_dim] bf16
        q, k, v = (nn.with_logical_constraint(t, _HEADS_ACT) for t in (q, k, v))
        if self.cache:
            k, v, mask = update_kv_cache(self, k, v, mask)
        dropout = nn.Dropout(cfg.attention_dropout_rate, deterministic=not train)
        # One query head per key head; masks [batch, 1, q_len, k_len] gain the group dim.
        out = attention(
            q[:, :, :, None], k, v, None if mask is None else mask[:, :, None], cfg.dtype, dropout
        )[:, :, :, 0]
        out = nn.with_logical_constraint(out, _HEADS_ACT)
        w_out = kernel(
            "out", (cfg.num_heads, head_dim, cfg.emb_dim), ("heads", "kv", "embed"), (0, 1)
        )
        return jnp.einsum("blhd,hde->ble", out, w_out)


class MlpBlock(nn.Module):
    """Position-wise feed-forward block: Dense -> ReLU -> Dense, with biases."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        h = nn.relu(_dense(cfg, cfg.mlp_dim, ("embed", "mlp"), name="wi")(x))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))  # [b, l, mlp] bf16
        return _dense(cfg, cfg.emb_dim, ("mlp", "embed"), name="wo")(h)


def _add_residual(x: Array, y: Array, rate: float, train: bool) -> Array:
    """x + dropout(y); called inside a compact method, so the Dropout binds to that module."""
    y = nn.Dropout(rate, deterministic=not train)(y)
    return nn.with_logical_constraint(x + y, _EMBED_ACT)


class EncoderLayer(nn.Module):
    """Pre-LN encoder layer: self-attention and MLP, each as x + dropout(f(LN(x))).

    Under `config.scan_layers` it is a scan body: it returns `(x, None)` (carry, no
    per-layer output).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array, train: bool) -> Array | tuple[Array, None]:
        cfg = self.config
        h = LayerNorm(cfg.dtype, cfg.param_dtype, name="attention_norm")(x)
        h = MultiHeadAttention(cfg, name="attention")(h, h, mask, train=train)
        x = _add_residual(x, h, cfg.dropout_rate, train)
        h = LayerNorm(cfg.dtype, cfg.param_dtype, name="mlp_norm")(x)
        x = _add_residual(x, MlpBlock(cfg, name="mlp")(h), cfg.dropout_rate, train)
        return (x, None) if cfg.scan_layers else x


class DecoderLayer(nn.Module):
    """Pre-LN decoder layer: causal self-attention, cross-attention, MLP (a scan body
    under `config.scan_layers`, as `EncoderLayer`)."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, y: Array, encoded: Array, self_mask: Array | None, cross_mask: Array, train: bool
    ) -> Array | tuple[Array, None]:
        cfg = self.config
        h = LayerNorm(cfg.dtype, cfg.param_dtype, name="self_attention_norm")(y)
        h = MultiHeadAttention(cfg, cache=cfg.decode, name="self_attention")(
            h, h, self_mask, train=train
        )
        y = _add_residual(y, h, cfg.dropout_rate, train)
        h = LayerNorm(cfg.dtype, cfg.param_dtype, name="cross_attention_norm")(y)
        h = MultiHeadAttention(cfg, name="cross_attention")(h, encoded, cross_mask, train=train)
        y = _add_residual(y, h, cfg.dropout_rate, train)
        h = LayerNorm(cfg.dtype, cfg.param_dtype, name="mlp_norm")(y)
        y = _add_residual(y, MlpBlock(cfg, name="mlp")(h), cfg.dropout_rate, train)
        return (y, None) if cfg.scan_layers else y


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see `TransformerConfig`.

    Attributes:
      config: the model's hyperparameters.
      layer_weights: ``(stack name, transform)`` pairs: the weights the stacks' layers
        compute with (:mod:`models.layer_stack`; empty: their parameters).
    """

    config: TransformerConfig
    layer_weights: tuple[tuple[str, layer_stack.LayerWeights], ...] = ()

    def setup(self) -> None:
        cfg = self.config
        table = dict(
            num_embeddings=cfg.vocab_size,
            features=cfg.emb_dim,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )
        if cfg.share_embeddings:
            self.shared_embedding = Embedding(**table)
        else:  # Separate source, target and output (logits) tables.
            self.encoder_embedding = Embedding(**table)
            self.decoder_embedding = Embedding(**table)
            self.logits_embedding = Embedding(**table)
        # `train` is passed positionally: a static argument of the remat'd layers.
        stack = dict(
            scan=cfg.scan_layers,
            remat=cfg.remat,
            layer_weights=self.layer_weights,
            unroll=cfg.scan_unroll,
            split_rngs=("dropout",),
        )
        self.encoder_layers = layer_stack.layer_stack(
            EncoderLayer,
            (cfg,),
            name="encoder_layers",
            length=cfg.num_encoder_layers,
            static_argnums=(3,),
            broadcast=2,
            **stack,
        )
        self.decoder_layers = layer_stack.layer_stack(
            DecoderLayer,
            (cfg,),
            name="decoder_layers",
            length=cfg.num_decoder_layers,
            static_argnums=(5,),
            broadcast=4,
            **stack,
        )
        self.encoder_norm = LayerNorm(cfg.dtype, cfg.param_dtype)
        self.decoder_norm = LayerNorm(cfg.dtype, cfg.param_dtype)
        self.embedding_dropout = nn.Dropout(cfg.dropout_rate)

    def _table(self, role: str) -> Embedding:
        if self.config.share_embeddings:
            return self.shared_embedding
        return getattr(self, f"{role}_embedding")

    def _embed(self, role: str, ids: Array, positions: Array | None, train: bool) -> Array:
        """Scaled token embedding + sinusoidal positions. [batch, length, emb] bf16."""
        cfg = self.config
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = self._table(role)(ids) * jnp.asarray(math.sqrt(cfg.emb_dim), cfg.dtype)
        x = x + sinusoidal_embedding(positions, cfg.emb_dim).astype(cfg.dtype)
        x = self.embedding_dropout(x, deterministic=not train)
        return nn.with_logical_constraint(x, _EMBED_ACT)

    def encode(
        self,
        inputs: Array,
        *,
        inputs_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Encodes int [batch, input_len] ids to [batch, input_len, emb_dim] in `dtype`.

        Arguments are as in `__call__`.
        """
        x = self._embed("encoder", inputs, inputs_positions, train)
        seg = inputs_segmentation
        mask = attention_mask(inputs > 0, inputs > 0, seg, seg)
        x = layer_stack.run(self.encoder_layers, x, mask, train)
        return self.encoder_norm(x)

    def decode(
        self,
        encoded: Array,
        inputs: Array,
        targets: Array,
        *,
        targets_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Float32 logits [batch, target_len, vocab] given `encoded` = the `encode` output.

        `inputs` are the source ids (for the padding mask). Teacher forcing: `targets` are
        whole target sequences, shifted right here. With config.decode: `targets` are the
        [batch, 1] tokens fed back from the previous step (BOS = 0 first) and
        `targets_positions` must hold the step index. Other arguments as in `__call__`.
        """
        if self.config.decode:
            decoder_inputs, self_mask = targets, None  # Cached self-attention masks itself.
            cross_mask = attention_mask(jnp.ones(targets.shape, bool), inputs > 0)
        else:
            decoder_inputs = shift_right(targets, targets_segmentation)
            # Validity follows the targets: position 0 holds BOS (= 0) but is real.
            valid, seg = targets > 0, targets_segmentation
            self_mask = attention_mask(valid, valid, seg, seg, causal=True)
            cross_mask = attention_mask(valid, inputs > 0, seg, inputs_segmentation)
        y = self._embed("decoder", decoder_inputs, targets_positions, train)
        y = layer_stack.run(self.decoder_layers, y, encoded, self_mask, cross_mask, train)
        logits = self._table("logits").attend(self.decoder_norm(y))
        # [batch, target_len, vocab] float32
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Teacher-forced logits, float32 [batch, target_len, vocab].

        Args:
          inputs: int [batch, input_len] source ids, 0 = padding.
          targets: int [batch, target_len] target ids, 0 = padding (shifted right inside).
          inputs_positions: int [batch, input_len] positions within segments (packing).
          targets_positions: int [batch, target_len] positions within segments.
          inputs_segmentation: int [batch, input_len] segment ids, 0 = padding; attention
            never crosses segments.
          targets_segmentation: int [batch, target_len] segment ids.
          train: enables dropout (needs the "dropout" rng).
        """
        longest = max(inputs.shape[1], targets.shape[1])
        if longest > self.config.max_len:
            raise ValueError(f"sequence length {longest} exceeds max_len {self.config.max_len}")
        encoded = self.encode(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            train=train,
        )
        return self.decode(
            encoded,
            inputs,
            targets,
            targets_positions=targets_positions,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
            train=train,
        )


def param_count(config: TransformerConfig) -> int:
    """Exact number of parameters, with V vocab, E emb, Q qkv, M mlp.

    Embeddings: V*E if shared, else 3*V*E (source, target and output tables).
    Attention 4*E*Q (q, k, v, out; no biases); MLP 2*E*M + M + E; LayerNorm 2*E.
    Encoder layer = attention + MLP + 2 LN; decoder layer = 2 attentions + MLP + 3 LN;
    plus a final LN per stack.
    """
    v, e, q, m = config.vocab_size, config.emb_dim, config.qkv_dim, config.mlp_dim
    embeddings = v * e if config.share_embeddings else 3 * v * e
    attention, mlp, norm = 4 * e * q, 2 * e * m + m + e, 2 * e
    encoder = config.num_encoder_layers * (attention + mlp + 2 * norm)
    decoder = config.num_decoder_layers * (2 * attention + mlp + 3 * norm)
    return embeddings + encoder + decoder + 2 * norm


def train_flops_per_example(config: TransformerConfig, input_len: int, target_len: int) -> float:
    """Model FLOPs of one training step on one example: 3 x forward matmul FLOPs.

    An [m, k] @ [k, n] matmul counts 2*m*n*k. Embedding gathers, LayerNorm, softmax and
    other elementwise work are ignored; attention counts the full (not causally halved)
    square. With S = input_len, T = target_len and E, Q, M, V = emb, qkv, mlp, vocab:

      encoder layer = S*(8*E*Q + 4*E*M) + 4*S^2*Q   (q/k/v/out, scores + values, MLP)
      decoder layer = T*(8*E*Q + 4*E*M) + 4*T^2*Q   (self-attention, MLP)
                      + 4*(T + S)*E*Q + 4*T*S*Q     (cross-attention)
      logits        = 2*T*E*V
      train         = 3 * (L_enc * encoder layer + L_dec * decoder layer + logits)
    """
    s, t = input_len, target_len
    e, q, m, v = config.emb_dim, config.qkv_dim, config.mlp_dim, config.vocab_size
    encoder_layer = s * (8 * e * q + 4 * e * m) + 4 * s * s * q
    decoder_layer = t * (8 * e * q + 4 * e * m) + 4 * t * t * q + 4 * (t + s) * e * q
    decoder_layer += 4 * t * s * q
    forward = (
        config.num_encoder_layers * encoder_layer
        + config.num_decoder_layers * decoder_layer
        + 2 * t * e * v
    )
    return 3.0 * forward

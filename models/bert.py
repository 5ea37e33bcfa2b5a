"""BERT (Devlin et al. 2018): a bidirectional encoder pretrained as a masked language model.

Post-LayerNorm, as the original: each sublayer is ``LN(x + dropout(f(x)))``; learned
position embeddings and a token-type table (every token is type 0 here: pretraining
is the masked language model alone, without next-sentence prediction, as RoBERTa
found it better; the table stays so that the model is BERT's to the parameter). The
masked-LM head transforms the hidden states at the masked positions only (dense,
GELU, LayerNorm) and scores them against the input table plus a bias.

Rows may pack several documents: ``segment_ids`` (1, 2, ...; 0 = padding) keep
attention inside each, and positions restart at 0 in each. Parameters carry logical
axis names as the other models' do ({"vocab", "embed", "heads", "kv", "mlp",
"layers"}); the attention projections are ``[heads, head_dim, embed]``, embed minor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import layer_stack
from models.layers import Embedding, LayerNorm, attention, named

Array = jax.Array
_EMBED_ACT = ("batch", "length", "embed")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyperparameters of BERT (defaults: BERT-large, uncased vocabulary).

    Attributes:
      vocab_size: token ids.
      num_layers: encoder layers; emb_dim: hidden size; num_heads: attention heads
        (emb_dim / num_heads channels each); mlp_dim: the feed-forward width.
      max_len: positions of the position table.
      type_vocab_size: token types (segments A and B of the original).
      layer_norm_eps: the LayerNorms' epsilon (1e-12, BERT's).
      dropout_rate: on embeddings and sublayer outputs; attention_dropout_rate: on
        attention weights (0.1 each, BERT's).
      init_std: standard deviation of the initial weights (0.02).
      dtype, param_dtype, remat, scan_layers, scan_unroll: as the other models'.
    """

    vocab_size: int = 30_522
    num_layers: int = 24
    emb_dim: int = 1024
    num_heads: int = 16
    mlp_dim: int = 4096
    max_len: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    remat: str = "none"
    scan_layers: bool = True
    scan_unroll: int = 1

    def __post_init__(self):
        if self.remat not in layer_stack.REMAT_POLICIES:
            raise ValueError(
                f"remat={self.remat!r} is not one of {', '.join(layer_stack.REMAT_POLICIES)}"
            )
        if self.num_heads < 1 or self.emb_dim % self.num_heads:
            raise ValueError(
                f"emb_dim={self.emb_dim} must split evenly over num_heads={self.num_heads}"
            )


def _norm(cfg: BertConfig, name: str) -> LayerNorm:
    return LayerNorm(cfg.dtype, cfg.param_dtype, cfg.layer_norm_eps, name=name)


class _Dense(nn.Module):
    """``x @ kernel + bias`` with named axes, in ``dtype``."""

    features: int
    names: tuple[str, str]
    config: BertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        kernel = self.param(
            "kernel",
            named(nn.initializers.normal(cfg.init_std), *self.names),
            (x.shape[-1], self.features),
            cfg.param_dtype,
        )
        bias = self.param(
            "bias", named(nn.initializers.zeros, self.names[-1]), (self.features,), cfg.param_dtype
        )
        return x @ kernel.astype(cfg.dtype) + bias.astype(cfg.dtype)


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward, each ``LN(x + dropout(f(x)))``; a scan body
    under ``scan_layers`` (it returns ``(x, None)``)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array, train: bool):
        cfg = self.config
        head_dim = cfg.emb_dim // cfg.num_heads
        init = nn.initializers.normal(cfg.init_std)
        drop = nn.Dropout(cfg.dropout_rate, deterministic=not train)

        def projection(name: str) -> Array:
            w = self.param(
                name,
                named(init, "heads", "kv", "embed"),
                (cfg.num_heads, head_dim, cfg.emb_dim),
                cfg.param_dtype,
            )
            b = self.param(
                f"{name}_bias",
                named(nn.initializers.zeros, "heads", "kv"),
                (cfg.num_heads, head_dim),
                cfg.param_dtype,
            )
            y = jnp.einsum("ble,hde->blhd", x, w.astype(cfg.dtype)) + b.astype(cfg.dtype)
            return nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))

        q, k, v = projection("query"), projection("key"), projection("value")
        attention_drop = nn.Dropout(cfg.attention_dropout_rate, deterministic=not train)
        heads = attention(q[:, :, :, None], k, v, mask[:, :, None], cfg.dtype, attention_drop)
        w_out = self.param(
            "out",
            named(init, "heads", "kv", "embed"),
            (cfg.num_heads, head_dim, cfg.emb_dim),
            cfg.param_dtype,
        )
        b_out = self.param(
            "out_bias", named(nn.initializers.zeros, "embed"), (cfg.emb_dim,), cfg.param_dtype
        )
        h = jnp.einsum("blhd,hde->ble", heads[:, :, :, 0], w_out.astype(cfg.dtype))
        x = _norm(cfg, "attention_norm")(x + drop(h + b_out.astype(cfg.dtype)))
        x = nn.with_logical_constraint(x, _EMBED_ACT)
        h = _Dense(cfg.mlp_dim, ("embed", "mlp"), cfg, name="intermediate")(x)
        h = nn.with_logical_constraint(
            jax.nn.gelu(h, approximate=False), ("batch", "length", "mlp")
        )
        h = _Dense(cfg.emb_dim, ("mlp", "embed"), cfg, name="output")(h)
        x = nn.with_logical_constraint(_norm(cfg, "output_norm")(x + drop(h)), _EMBED_ACT)
        return (x, None) if cfg.scan_layers else x


class Bert(nn.Module):
    """BERT with its masked-LM head; see :class:`BertConfig`.

    Attributes:
      config: the model's hyperparameters.
      layer_weights: ``(stack name, transform)`` pairs: the weights the stack's layers
        compute with (:mod:`models.layer_stack`; empty: their parameters).
    """

    config: BertConfig
    layer_weights: tuple[tuple[str, layer_stack.LayerWeights], ...] = ()

    def setup(self) -> None:
        cfg = self.config
        table = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, stddev=cfg.init_std)
        self.token_embedding = Embedding(cfg.vocab_size, cfg.emb_dim, **table)
        self.position_embedding = Embedding(cfg.max_len, cfg.emb_dim, **table)
        self.type_embedding = Embedding(cfg.type_vocab_size, cfg.emb_dim, **table)
        self.embedding_norm = _norm(cfg, "embedding_norm")
        self.embedding_dropout = nn.Dropout(cfg.dropout_rate)
        # `train` is passed positionally: a static argument of the remat'd layers.
        self.layers = layer_stack.layer_stack(
            EncoderLayer,
            (cfg,),
            name="layers",
            length=cfg.num_layers,
            scan=cfg.scan_layers,
            remat=cfg.remat,
            static_argnums=(3,),
            broadcast=2,
            layer_weights=self.layer_weights,
            unroll=cfg.scan_unroll,
            split_rngs=("dropout",),
        )
        self.head_transform = _Dense(cfg.emb_dim, ("embed", "mlp"), cfg)
        self.head_norm = _norm(cfg, "head_norm")
        self.head_bias = self.param(
            "head_bias", named(nn.initializers.zeros, "vocab"), (cfg.vocab_size,), cfg.param_dtype
        )

    def __call__(
        self,
        ids: Array,
        positions: Array,
        segment_ids: Array,
        masked_positions: Array,
        *,
        train: bool = False,
    ) -> Array:
        """Float32 logits [batch, predictions, vocab] at ``masked_positions``.

        Args:
          ids: int [batch, length] tokens (the masked ones replaced).
          positions: int [batch, length] positions within each document.
          segment_ids: int [batch, length] documents of a packed row (0 = padding).
          masked_positions: int [batch, predictions] where to predict the original token.
          train: enables dropout (needs the "dropout" rng).
        """
        cfg = self.config
        if ids.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len {cfg.max_len}")
        x = (
            self.token_embedding(ids)
            + self.position_embedding(positions)
            + self.type_embedding(jnp.zeros_like(ids))
        )
        x = self.embedding_dropout(self.embedding_norm(x), deterministic=not train)
        x = nn.with_logical_constraint(x, _EMBED_ACT)
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids > 0)[:, :, None]
        mask = mask[:, None]  # [batch, 1, length, length]
        x = layer_stack.run(self.layers, x, mask, train)
        picked = jnp.take_along_axis(x, masked_positions[..., None], axis=1)
        h = self.head_norm(jax.nn.gelu(self.head_transform(picked), approximate=False))
        logits = self.token_embedding.attend(h) + self.head_bias.astype(jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def param_count(cfg: BertConfig) -> int:
    """Exact number of parameters, as Hugging Face's BertForMaskedLM has them (no pooler:
    no next-sentence prediction), with V vocab, P positions, T types, E hidden, M mlp,
    L layers: tables (V + P + T) * E and their norm 2E; per layer attention 4(E^2 + E),
    feed-forward 2EM + M + E, two norms 4E; the head E^2 + E, its norm 2E, a bias V."""
    v, e, m = cfg.vocab_size, cfg.emb_dim, cfg.mlp_dim
    embeddings = (v + cfg.max_len + cfg.type_vocab_size) * e + 2 * e
    layer = 4 * (e * e + e) + 2 * e * m + m + e + 4 * e
    head = e * e + e + 2 * e + v
    return embeddings + cfg.num_layers * layer + head


def train_flops_per_token(cfg: BertConfig, length: int, predictions: int) -> float:
    """Model FLOPs of one training token (3 x the forward's): every layer's matmuls
    (2 FLOPs a weight: 4 E^2 + 2 E M), attention's two (4 x length x E a layer,
    bidirectional: no halving), and the head's transform and vocabulary matmuls at
    the ``predictions`` masked positions of a row, per token."""
    e, m = cfg.emb_dim, cfg.mlp_dim
    layer = 2 * (4 * e * e + 2 * e * m) + 4 * length * e
    head = 2 * (e * e + e * cfg.vocab_size) * predictions / length
    return 3.0 * (cfg.num_layers * layer + head)

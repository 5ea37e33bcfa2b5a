"""Neural collaborative filtering: NeuMF (He et al. 2017), as in MLPerf v0.7 recommendation.

NeuMF scores a (user, item) pair with two branches that share nothing but the output layer:
  * GMF: the elementwise product of a user and an item embedding (width `mf_dim`), a
    generalised matrix factorisation;
  * MLP: the concatenation of two further embeddings (each `mlp_layers[0] / 2` wide) through
    Dense + ReLU layers of widths `mlp_layers[1:]`;
and a final Dense maps [GMF | MLP] to one logit (the log-odds of an interaction).

The model knows nothing of meshes: every parameter carries logical axis names from
{"users", "items", "embed", "mlp_in", "mlp", "logit"} and key activations carry constraints
from {"batch", "embed", "mlp"}; the trainer maps them to mesh axes. A kernel's input axis is
"mlp_in" and its output axis "mlp" (or "logit"), so rules can shard the two differently.

The metrics helpers are jit-friendly and return sums, which add up across batches and
processes; the trainer divides by the total weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NCFConfig:
    """Hyperparameters of NeuMF (defaults: MLPerf v0.7 on MovieLens-20M).

    `mlp_layers[0]` is the width of the concatenated user + item MLP embedding (each half of
    it); the remaining entries are the widths of the Dense + ReLU layers.
    """

    num_users: int
    num_items: int
    mf_dim: int = 64
    mlp_layers: tuple[int, ...] = (256, 256, 128, 64)
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.num_users < 1 or self.num_items < 1:
            raise ValueError(
                f"num_users={self.num_users} and num_items={self.num_items} must be >= 1"
            )
        if self.mf_dim < 1:
            raise ValueError(f"mf_dim={self.mf_dim} must be >= 1")
        if not self.mlp_layers or min(self.mlp_layers) < 1 or self.mlp_layers[0] % 2:
            raise ValueError(
                f"mlp_layers={self.mlp_layers} must be positive widths, the first one even "
                "(it is split between the user and the item MLP embedding)"
            )


def _named(init: Any, *names: str) -> Any:
    return nn.with_logical_partitioning(init, names)


class NCF(nn.Module):
    """NeuMF; see the module docstring and `NCFConfig`."""

    config: NCFConfig

    def _embed(self, name: str, ids: Array, table_axis: str, rows: int, features: int) -> Array:
        """Rows `ids` of a [rows, features] table, in `dtype`: [batch, features]."""
        cfg = self.config
        # Small normal embeddings (std 0.01), as in the MLPerf reference.
        init = _named(nn.initializers.normal(stddev=0.01), table_axis, "embed")
        table = self.param(name, init, (rows, features), cfg.param_dtype)
        return nn.with_logical_constraint(
            jnp.take(table, ids, axis=0).astype(cfg.dtype), ("batch", "embed")
        )

    @nn.compact
    def __call__(self, users: Array, items: Array, *, train: bool = False) -> Array:
        """Interaction logits of (user, item) pairs.

        Args:
          users: int [batch] dense user ids in [0, num_users).
          items: int [batch] dense item ids in [0, num_items).
          train: unused (NeuMF has no dropout); kept for the trainer's common signature.

        Returns:
          float32 [batch] logits; sigmoid(logit) is the predicted interaction probability.
        """
        del train
        cfg = self.config
        half = cfg.mlp_layers[0] // 2
        mf_user = self._embed("mf_user", users, "users", cfg.num_users, cfg.mf_dim)
        mf_item = self._embed("mf_item", items, "items", cfg.num_items, cfg.mf_dim)
        mlp_user = self._embed("mlp_user", users, "users", cfg.num_users, half)
        mlp_item = self._embed("mlp_item", items, "items", cfg.num_items, half)

        gmf = mf_user * mf_item  # [batch, mf_dim]
        h = nn.with_logical_constraint(
            jnp.concatenate([mlp_user, mlp_item], axis=-1), ("batch", "mlp")
        )  # [batch, mlp_layers[0]]
        for index, width in enumerate(cfg.mlp_layers[1:]):
            dense = nn.Dense(
                width,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=_named(nn.initializers.xavier_uniform(), "mlp_in", "mlp"),
                bias_init=_named(nn.initializers.zeros, "mlp"),
                name=f"mlp_{index}",
            )
            h = nn.with_logical_constraint(nn.relu(dense(h)), ("batch", "mlp"))
        features = jnp.concatenate([gmf, h], axis=-1)  # [batch, mf_dim + mlp_layers[-1]]
        # The output layer runs in float32: it is tiny, and logits are never rounded to bf16.
        logits = nn.Dense(
            1,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            kernel_init=_named(nn.initializers.lecun_uniform(), "mlp_in", "logit"),
            bias_init=_named(nn.initializers.zeros, "logit"),
            name="logits",
        )(features)
        return nn.with_logical_constraint(logits[:, 0], ("batch",))


def _dense_shapes(config: NCFConfig) -> list[tuple[int, int]]:
    """(inputs, outputs) of every Dense layer, the output layer last."""
    widths = config.mlp_layers
    shapes = list(zip(widths[:-1], widths[1:], strict=True))
    return shapes + [(config.mf_dim + widths[-1], 1)]


def param_count(config: NCFConfig) -> int:
    """Exact number of parameters.

    With U users, I items, F = mf_dim and layer widths w_0..w_L:
    embeddings (U + I) * (F + w_0 / 2); Dense layers sum(w_j * w_{j+1} + w_{j+1});
    output layer (F + w_L) + 1.
    """
    tables = (config.num_users + config.num_items) * (config.mf_dim + config.mlp_layers[0] // 2)
    return tables + sum(fan_in * fan_out + fan_out for fan_in, fan_out in _dense_shapes(config))


def train_flops_per_example(config: NCFConfig) -> float:
    """Model FLOPs of one training step on one (user, item) example: 3 x forward Dense FLOPs.

    A Dense layer [1, m] @ [m, n] counts 2*m*n. Embedding gathers, the GMF product, biases
    and ReLUs are ignored (they are memory-bound and O(width)), as is the backward pass into
    the embedding tables, which is a scatter-add.
    """
    forward = sum(2 * fan_in * fan_out for fan_in, fan_out in _dense_shapes(config))
    return 3.0 * forward


def loss_and_metrics(
    logits: Array, labels: Array, weights: Array
) -> tuple[Array, dict[str, Array]]:
    """Sigmoid binary cross entropy, summed (not averaged) over examples.

    Args:
      logits: float [batch] (the `NCF` output).
      labels: float [batch], 1 for an interaction, 0 for a sampled negative.
      weights: float [batch]; 0 masks padding rows.

    Returns:
      (loss_sum, metrics); metrics holds sums "loss", "accuracy" (examples with
      (logit > 0) == label) and "weight" (the total weight).
    """
    logits = logits.astype(jnp.float32)
    labels = labels.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    # -[y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))] = log(1 + e^x) - y x, stably.
    losses = jnp.logaddexp(0.0, logits) - labels * logits
    loss = (losses * weights).sum()
    correct = (logits > 0) == (labels > 0.5)
    metrics = {"loss": loss, "accuracy": (correct * weights).sum(), "weight": weights.sum()}
    return loss, metrics


def hit_rate_and_ndcg(
    scores: Array, positive_index: int = 0, k: int = 10, weights: Array | None = None
) -> tuple[Array, Array]:
    """Sums of HR@k and NDCG@k over users, for leave-one-out evaluation.

    The positive's rank (0-based) is the number of negatives that score at least as high:
    ties count against the positive, so a constant model scores like the worst ranking, not
    the best. HR@k is 1 if rank < k; NDCG@k is 1 / log2(rank + 2) if rank < k, else 0.

    Args:
      scores: float [users, 1 + num_negatives]; any monotone score (logits are fine).
      positive_index: the column of the held-out positive; every other column is a negative.
      k: the cut-off.
      weights: float [users]; 0 masks padding rows. Defaults to all ones.

    Returns:
      (hr_sum, ndcg_sum), float32 scalars.
    """
    scores = scores.astype(jnp.float32)
    positive = scores[:, positive_index]
    # "not below" rather than ">=": a NaN anywhere counts against the positive too. The
    # positive's own column always counts: subtract it.
    rank = jnp.logical_not(scores < positive[:, None]).sum(axis=-1) - 1
    hit = rank < k
    ndcg = jnp.where(hit, 1.0 / jnp.log2(rank.astype(jnp.float32) + 2.0), 0.0)
    if weights is None:
        weights = jnp.ones(positive.shape, jnp.float32)
    weights = weights.astype(jnp.float32)
    return (hit * weights).sum(), (ndcg * weights).sum()

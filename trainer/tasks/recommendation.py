"""Implicit-feedback recommendation with NeuMF: binary cross entropy, HR@10, NDCG@10."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from models import ncf
from trainer.errors import ConfigError, floating_dtype
from trainer.input import movielens
from trainer.tasks.base import HostEvaluation, Task


def make_task(
    config: ml_collections.ConfigDict, open_data: Callable[[], movielens.MovieLensData] | None
) -> Task:
    """The NCF task of ``config`` on this process's data from ``open_data`` (None:
    model and shapes only, see :func:`trainer.tasks.make_task`).

    The embedding tables have ``config.model.num_users`` / ``num_items`` rows;
    the data's dense ids must fit in them.
    """
    cfg = ncf.NCFConfig(
        num_users=config.model.num_users,
        num_items=config.model.num_items,
        mf_dim=config.model.mf_dim,
        mlp_layers=tuple(config.model.mlp_layers),
        dtype=floating_dtype(config.model.dtype, "model.dtype"),
        param_dtype=floating_dtype(config.model.param_dtype, "model.param_dtype"),
    )
    data = open_data() if open_data else None
    if data is not None:
        for key, n in (("num_users", data.num_users), ("num_items", data.num_items)):
            if n > config.model[key]:
                raise ConfigError(f"the data has {n} {key[4:]} but model.{key}={config.model[key]}")
    model = ncf.NCF(cfg)
    eval_model = ncf.NCF(
        dataclasses.replace(cfg, dtype=floating_dtype(config.eval_dtype, "eval_dtype"))
    )
    init_batch = {
        "users": np.zeros((1,), np.int32),
        "items": np.zeros((1,), np.int32),
        "labels": np.zeros((1,), np.float32),
        "weights": np.ones((1,), np.float32),
    }

    def init_fn(rng, batch):
        return model.init({"params": rng}, batch["users"], batch["items"])

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        del layer_weights  # no stack of layers
        del rng  # NeuMF has no dropout
        logits = (model if train else eval_model).apply(
            variables, batch["users"], batch["items"], train=train
        )
        loss, sums = ncf.loss_and_metrics(logits, batch["labels"], batch["weights"])
        return loss, (sums, {})

    def weight_fn(batch):
        return jnp.sum(batch["weights"])

    @functools.cache
    def ranking_sums():
        def fn(params, users, items, weights):
            # Score every (user, candidate) pair: [users, 1 + negatives].
            pairs = jnp.broadcast_to(users[:, None], items.shape)
            scores = eval_model.apply({"params": params}, pairs.reshape(-1), items.reshape(-1))
            hits, ndcg = ncf.hit_rate_and_ndcg(scores.reshape(items.shape), weights=weights)
            return hits, ndcg, jnp.sum(weights)

        return jax.jit(fn)

    def ranking(variables, to_global, to_local) -> HostEvaluation:
        del to_local  # the sums are global
        totals = np.zeros(3)
        for batch in data.eval_batches():
            batch = to_global(batch)
            sums = ranking_sums()(
                variables["params"], batch["users"], batch["items"], batch["weights"]
            )
            totals += np.asarray(jax.device_get(sums), np.float64)
        users = max(totals[2], 1.0)
        return HostEvaluation({"hr@10": totals[0] / users, "ndcg@10": totals[1] / users})

    return Task(
        model=model,
        eval_model=eval_model,
        init_batch=init_batch,
        train_data=data and data.train,
        # Eval rows are users with ranked candidates, not training pairs: the
        # ranking metrics below are the whole evaluation.
        eval_batches=lambda: (),
        loss_fn=loss_fn,
        weight_fn=weight_fn,
        init_fn=init_fn,
        evaluate_extra=ranking if data else None,
        flops_per_example=ncf.train_flops_per_example(cfg),
    )

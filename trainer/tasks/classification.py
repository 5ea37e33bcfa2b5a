"""Image classification with ResNet: label-smoothed cross entropy, top-1/top-5."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from models import losses, resnet
from trainer.errors import ConfigError, floating_dtype
from trainer.input import imagenet
from trainer.tasks.base import REPLICAS, Task

# ImageNet channel statistics, on the 0..255 scale: the host ships uint8 crops
# and the device normalises (cheap there, and 4x fewer bytes to transfer).
_MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
_STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


def make_task(
    config: ml_collections.ConfigDict, open_data: Callable[[], imagenet.ImageData] | None
) -> Task:
    """The image-classification task of ``config`` on this process's data from
    ``open_data`` (None: model and shapes only, see :func:`trainer.tasks.make_task`)."""
    cfg = resnet.ResNetConfig(
        **resnet.SIZES[config.model.size],
        num_classes=config.model.num_classes,
        dtype=floating_dtype(config.model.dtype, "model.dtype"),
        param_dtype=floating_dtype(config.model.param_dtype, "model.param_dtype"),
        bn_axis_name=REPLICAS,
        bn_group_size=config.model.bn_group_size,
        remat=config.model.remat,
    )
    data = open_data() if open_data else None
    if data is not None and data.num_classes != cfg.num_classes:
        raise ConfigError(
            f"the data has {data.num_classes} classes but model.num_classes={cfg.num_classes}"
        )
    model = resnet.ResNet(cfg)
    eval_model = resnet.ResNet(
        dataclasses.replace(cfg, dtype=floating_dtype(config.eval_dtype, "eval_dtype"))
    )
    size = config.data.image_size
    label_smoothing = config.label_smoothing
    init_batch = {
        "images": np.zeros((1, size, size, 3), np.uint8),
        "labels": np.zeros((1,), np.int32),
    }

    def normalize(images):
        return (images.astype(jnp.float32) - _MEAN) / _STD

    def init_fn(rng, batch):
        return model.init({"params": rng}, normalize(batch["images"]), train=False)

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        del layer_weights  # no stack of layers
        del rng  # no dropout; augmentation happens on the host
        images = normalize(batch["images"])
        if train:
            logits, model_state = model.apply(
                variables, images, train=True, mutable=["batch_stats"]
            )
        else:
            logits, model_state = eval_model.apply(variables, images, train=False), {}
        labels = batch["labels"]
        weights = batch.get("weights", jnp.ones(labels.shape, jnp.float32))
        loss, sums = losses.cross_entropy_and_metrics(logits, labels, weights, label_smoothing)
        top5 = jax.lax.top_k(logits, 5)[1] == labels[:, None]
        sums["top5_accuracy"] = jnp.sum(top5.any(-1) * weights)
        return loss, (sums, model_state)

    def weight_fn(batch):
        return jnp.asarray(batch["labels"].shape[0], jnp.float32)

    return Task(
        model=model,
        eval_model=eval_model,
        init_batch=init_batch,
        train_data=data and data.train,
        eval_batches=data.eval_batches if data else lambda: (),
        loss_fn=loss_fn,
        weight_fn=weight_fn,
        init_fn=init_fn,
        flops_per_example=resnet.train_flops_per_example(cfg, size),
    )

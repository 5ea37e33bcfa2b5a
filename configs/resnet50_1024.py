"""ResNet-50 v1.5 with LARS at 1024 TPU-v3 chips (2048 cores), global batch 32768.

The 2048-core row of Xu et al. 2020, Table 1; otherwise as configs/resnet50_16.py
(whose docstring says how to prepare ImageNet). BatchNorm statistics span groups
of 16 replicas here, as MLPerf submissions at this scale do.

  python -m trainer --config configs/resnet50_1024.py --workdir gs://bucket/r50
  python -m trainer --config configs/resnet50_1024.py:tiny --workdir /tmp/r50 --cpu_devices 8
"""

import ml_collections

from configs import common, resnet50_16

VARIANTS = resnet50_16.VARIANTS


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    config = resnet50_16.get_config(variant)
    if "tiny" in common.variant_parts(variant, VARIANTS):
        config.model.bn_group_size = 2
        return config
    config.global_batch_size = 32_768
    images = resnet50_16.IMAGENET_TRAIN_IMAGES
    config.num_train_steps = 44 * images // config.global_batch_size
    config.eval_every_steps = 4 * images // config.global_batch_size // 10 * 10
    config.steps_per_loop = 10
    config.log_every_steps = 10
    config.checkpoint_every_steps = config.eval_every_steps
    config.model.bn_group_size = 16
    config.optimizer.update(learning_rate=25.0, warmup_steps=5 * images // config.global_batch_size)
    return config

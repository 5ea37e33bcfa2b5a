"""Keys every run config has, with their defaults.

Each ``configs/<name>.py`` starts from :func:`base_config` and sets what its
model needs, so the trainer never guesses a default with ``config.get``.
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    """The common top-level keys and the mesh and optimizer sections."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.global_batch_size = 256
    config.num_train_steps = 1000
    # K training steps run inside one compiled call; Python only runs between loops,
    # so the *_every_steps below must be multiples of it.
    config.steps_per_loop = 10
    config.log_every_steps = 100
    config.eval_every_steps = 1000
    config.checkpoint_every_steps = 1000  # 0 = only at the end
    config.keep_checkpoints = 3
    # Peak FLOP/s of one device for MFU. Default: a TPU-v3 core in bf16 (61.5 TFLOP/s,
    # i.e. 123 per chip); set it to your hardware (trainer.bench measures a CPU's).
    config.peak_flops_per_device = 61.5e12

    config.mesh = ml_collections.ConfigDict()
    # Per-slice axis sizes; -1 = the devices the other axes leave.
    config.mesh.axes = ml_collections.ConfigDict({"data": -1, "model": 1})
    # How many slices each axis spans (multi-slice runs over DCN).
    config.mesh.dcn_axes = ml_collections.ConfigDict({"data": 1, "model": 1})
    config.mesh.rules = (("batch", "data"),)
    # Use only the first N devices (0 = all), e.g. to try a smaller mesh on a laptop.
    config.mesh.num_devices = 0

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 1e-3
    config.optimizer.schedule = "constant"
    config.optimizer.warmup_steps = 0
    config.optimizer.end_learning_rate = 0.0  # polynomial schedule
    config.optimizer.power = 2.0  # polynomial schedule
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.999
    config.optimizer.eps = 1e-8
    config.optimizer.weight_decay = 0.0
    config.optimizer.momentum = 0.9  # momentum, lars
    config.optimizer.nesterov = False
    config.optimizer.trust_coefficient = 0.001  # lars
    config.optimizer.clip_norm = 0.0  # 0 = no global-norm clipping
    # Weight-update sharding (Xu et al. 2020): none | wus | fsdp.
    config.optimizer.update_sharding = "wus"
    config.optimizer.gather_dtype = "bfloat16"
    config.optimizer.reduce_dtype = "float32"
    # Shard the update within groups of this many data replicas (0 = all of them).
    config.optimizer.shard_group_size = 0
    # Parameters smaller than this (as f32) keep a replicated update.
    config.optimizer.min_shard_bytes = 65536
    return config

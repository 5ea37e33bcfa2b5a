"""ResNet-50 v1.5 on ImageNet with LARS: the 32-core row of Xu et al. 2020, Table 1.

16 TPU-v3 chips (32 cores), global batch 4096, LARS (no weight decay or trust
ratio on biases and BatchNorm parameters), polynomial decay after a linear
warm-up, label smoothing 0.1, bf16 compute with f32 parameters, BatchNorm
statistics over the whole data-parallel batch (``model.bn_group_size`` = G
averages them within groups of G replicas, MLPerf's "BN span").

Run (needs the prepared dataset: put the ImageNet tars in DIR/downloads/manual,
then `tfds build imagenet2012 --file_format=array_record --data_dir=DIR`):

  python -m trainer --config configs/resnet50_16.py --workdir /tmp/r50

A laptop-sized variant (a tiny ResNet on the embedded synthetic images):

  python -m trainer --config configs/resnet50_16.py:tiny --workdir /tmp/r50_tiny --cpu_devices 8

The input pipeline alone on ImageNet-size JPEGs generated locally (``local_jpeg``,
combinable with ``tiny``), in images/s per host core:

  python -m trainer.data.bench --config configs/resnet50_16.py:local_jpeg --workers 0,1,2

The learning rates are starting points scaled from published large-batch LARS
runs, not tuned here.
"""

import ml_collections

from configs import common

IMAGENET_TRAIN_IMAGES = 1_281_167


# The variants after ``:`` on the command line, combinable with commas.
VARIANTS = {
    "tiny": "a tiny ResNet on the embedded synthetic images",
    "local_jpeg": "ImageNet-size JPEGs generated locally (for trainer.data.bench)",
}


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    config = common.base_config()
    config.global_batch_size = 4096
    epochs = 44
    config.num_train_steps = epochs * IMAGENET_TRAIN_IMAGES // config.global_batch_size
    config.steps_per_loop = 100
    config.log_every_steps = 100
    config.eval_every_steps = 4 * IMAGENET_TRAIN_IMAGES // config.global_batch_size // 100 * 100
    config.checkpoint_every_steps = config.eval_every_steps
    config.label_smoothing = 0.1  # of the training loss's one-hot targets
    config.model = ml_collections.ConfigDict(
        # num_classes must match the data's (checked when it is read).
        dict(
            name="resnet",  # the model family (models/)
            size="resnet50",  # a depth of models/resnet.py:SIZES (resnet18 ... resnet152, tiny)
            num_classes=1000,  # outputs of the classifier
            dtype="bfloat16",  # activations and convolutions
            param_dtype="float32",  # the master weights
            bn_group_size=0,  # batch norm statistics over groups of N replicas; 0 = all
            remat="none",  # rematerialisation per block: none | full | dots | dots_no_batch
        )
    )
    config.data = common.data_config(
        "imagenet2012",
        # ~400 images/s per core (python -m trainer.data.bench, :local_jpeg); a TPU-v3
        # host consumes ~7,500-10,000 images/s: ~20-25 cores, plus headroom.
        worker_count=32,
        image_size=224,  # pixels of the square crops
        eval_split="validation",  # the TFDS split evaluated on
        num_eval_examples=-1,  # eval examples (the first N); -1 = all
    )
    config.optimizer.update(
        name="lars",
        learning_rate=9.0,
        schedule="polynomial",
        power=2.0,
        warmup_steps=5 * IMAGENET_TRAIN_IMAGES // config.global_batch_size,
        weight_decay=5e-5,
        momentum=0.9,
        trust_coefficient=0.001,
    )
    config.mesh.rules = (
        ("batch", "data"),
        ("height", None),
        ("width", None),
        ("channels", None),
        ("channels_in", None),
        ("conv_h", None),
        ("conv_w", None),
        ("classes", None),
    )
    parts = common.variant_parts(variant, VARIANTS)
    if "tiny" in parts:
        config.model.size = "tiny"
        config.model.num_classes = 10
        config.global_batch_size = 128
        config.num_train_steps = 200
        config.steps_per_loop = 20
        config.log_every_steps = 100
        config.eval_every_steps = 200
        config.checkpoint_every_steps = 200
        config.data.update(name="tiny_images", image_size=32, num_eval_examples=-1, worker_count=0)
        config.optimizer.update(learning_rate=2.0, warmup_steps=30, min_shard_bytes=1024)
    if "local_jpeg" in parts:
        # ImageNet-size JPEGs generated on this machine (trainer/input/builders/local_jpeg.py): the
        # real decode and augmentation at 224x224, measured by `python -m trainer.data.bench`.
        config.data.update(name="local_jpeg", image_size=224, worker_count=2)
    return config

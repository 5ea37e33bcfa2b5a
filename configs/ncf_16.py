"""NCF (NeuMF) on MovieLens-20M: the 32-core row of Xu et al. 2020, Table 1.

16 TPU-v3 chips (32 cores), global batch 98304, Adam, weight-update sharding.
NeuMF with 64 factors and MLP 256-256-128-64 (MLPerf v0.7 recommendation);
implicit feedback, leave-one-out, 4 negatives per positive for training,
HR@10 / NDCG@10 against 999 sampled negatives (MLPerf target HR@10 0.635).

Run (needs the prepared dataset: `tfds build movielens/20m-ratings
--file_format=array_record --data_dir=DIR`):

  python -m trainer --config configs/ncf_16.py --workdir /tmp/ncf

A laptop-sized variant on the embedded synthetic implicit-feedback data:

  python -m trainer --config configs/ncf_16.py:tiny --workdir /tmp/ncf_tiny --cpu_devices 8

The input pipeline alone at MovieLens-20M scale, on ratings generated locally:

  python -m trainer.data.bench --config configs/ncf_16.py:local_20m --workers 0,1,2
"""

import ml_collections

from configs import common

# The variants after ``:`` on the command line, combinable with commas.
VARIANTS = {
    "tiny": "a small NeuMF on the embedded implicit-feedback data",
    "local_20m": "MovieLens-20M-sized ratings generated locally (for trainer.data.bench)",
}


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    config = common.base_config()
    config.global_batch_size = 98_304
    config.num_train_steps = 2_000  # ~20 epochs of 99M training pairs / 98304
    config.steps_per_loop = 100
    config.log_every_steps = 100
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    # Embedding rows: MovieLens-20M's 138,493 users and the 26,744 movies they rated
    # (dense ids of the prepared data must fit; sizes known without reading it).
    config.model = ml_collections.ConfigDict(
        dict(
            name="ncf",  # the model family (models/)
            num_users=138_493,  # user embedding rows
            num_items=26_744,  # item embedding rows
            mf_dim=64,  # the matrix-factorisation branch's embedding width
            mlp_layers=(256, 256, 128, 64),  # widths of the MLP branch
            dtype="bfloat16",  # activations and matmuls
            param_dtype="float32",  # the master weights
        )
    )
    # No eval_split: MovieLens has only "train"; eval is leave-one-out of it.
    config.data = common.data_config(
        "movielens/20m-ratings",
        # ~0.5-0.8M examples/s per core (python -m trainer.data.bench): a TPU-v3 host
        # consuming ~5-25M examples/s needs ~10-40 cores; workers each hold ~0.5 GB.
        worker_count=16,
        num_negatives=4,  # sampled unrated items per rated one, in training
        num_eval_negatives=999,  # unrated items ranked against each held-out one
    )
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.002
    config.optimizer.warmup_steps = 100
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.999
    config.mesh.rules = (
        ("batch", "data"),
        ("users", None),
        ("items", None),
        ("embed", None),
        ("mlp_in", None),
        ("mlp", None),
        ("logit", None),
    )
    parts = common.variant_parts(variant, VARIANTS)
    if "tiny" in parts:
        config.global_batch_size = 1024
        config.num_train_steps = 400
        config.steps_per_loop = 20
        config.log_every_steps = 100
        config.eval_every_steps = 200
        config.checkpoint_every_steps = 200
        config.data.update(name="tiny_movielens", num_eval_negatives=99, worker_count=0)
        config.model.update(num_users=1000, num_items=500)
        config.optimizer.learning_rate = 0.005
        config.optimizer.warmup_steps = 20
        config.optimizer.min_shard_bytes = 4096
    if "local_20m" in parts:
        # MovieLens-20M-sized ratings generated on this machine
        # (trainer/input/builders/local_movielens.py), to measure start-up and input
        # throughput: `python -m trainer.data.bench`.
        config.data.name = "local_movielens"
    return config

"""Transformer (big) on WMT14 en-de: the 32-core row of Xu et al. 2020, Table 1.

16 TPU-v3 chips (32 cores), global batch 512 (16 sequences of 256 tokens per
core), Adam; otherwise as configs/transformer_1024.py (model, optimizer and
schedule, not retuned for the smaller batch). The paper reports about 9% shorter
steps with weight-update sharding here (section 6.1).

Run (needs the prepared dataset, see trainer/input/translation.py):

  python -m trainer --config configs/transformer_16.py --workdir /tmp/wmt16

Compile it for the 16-chip slice without a TPU or the dataset:

  python -m trainer.aot --config configs/transformer_16.py:synthetic --topology v3:4x4

Variants are those of configs/transformer_1024.py (``tiny``, ``base``,
``synthetic``, ``update_heavy``, combinable with commas).
"""

import ml_collections

from configs import common, transformer_1024

VARIANTS = transformer_1024.VARIANTS


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    config = transformer_1024.get_config(variant)
    parts = common.variant_parts(variant, VARIANTS)
    if not {"tiny", "update_heavy"} & parts:
        config.global_batch_size = 512
    return config

"""Every config builds in each of its variants, refuses unknown ones alike, and
declares the keys the trainer reads (no hidden defaults)."""

import importlib

import pytest

from configs import common

VARIANTS = {
    "transformer_1024": ("", "tiny", "base,synthetic", "base,synthetic,update_heavy"),
    "transformer_16": ("", "tiny", "synthetic"),
    "resnet50_16": ("", "tiny", "local_jpeg"),
    "resnet50_1024": ("", "tiny"),
    "ncf_16": ("", "tiny", "local_20m"),
    "maxtext": ("", "tiny", "v5e-16b", "v5p-32b,slices=2"),
    "llama": ("", "tiny", "text", "llama3-70b,synthetic"),
    "bert_large": ("", "tiny", "synthetic"),
}


def flat_keys(config, prefix=""):
    keys = set()
    for key, value in config.items():
        keys.add(prefix + key)
        if hasattr(value, "items"):
            keys |= flat_keys(value, f"{prefix}{key}.")
    return keys


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_build_and_unknown_ones_are_named(name):
    module = importlib.import_module(f"configs.{name}")
    base = flat_keys(common.base_config())
    for variant in VARIANTS[name]:
        config = module.get_config(variant)
        assert base <= flat_keys(config), (name, variant, base - flat_keys(config))
        # The data keys every pipeline reads (configs/common.py:data_config).
        assert isinstance(config.data.name, str) and config.data.worker_count >= 0
        shared = {
            key: config.data[key] for key in ("data_dir", "train_split", "worker_buffer_size")
        }
        assert shared == {"data_dir": None, "train_split": "train", "worker_buffer_size": 2}
    with pytest.raises(ValueError, match=r"unknown variant \['nope'\] \(expected tiny"):
        module.get_config("tiny,nope")

"""The language-model keys of the data config, and the batches' field names."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.errors import ConfigError
from trainer.input import options

SYNTHETIC = "synthetic"
DECODER_KEYS = ("inputs", "targets", "segmentation", "positions", "weights")
MASKED_KEYS = (
    "inputs",
    "segmentation",
    "positions",
    "masked_positions",
    "masked_ids",
    "masked_weights",
)


@dataclasses.dataclass(frozen=True)
class LanguageOptions:
    """The language-model keys of the data config.

    Attributes:
      train_files, eval_files: globs of documents (:mod:`trainer.input.text_files`);
        eval_files "": hold out ``eval_holdout`` of the training documents instead.
      eval_holdout: the share of the training documents held out for evaluation when
        no eval_files are given.
      train_on_prompts: conversations (``data.name="chat"``): the loss counts every
        token, not only the answers'.
      document: how a ``.txt`` file holds documents (``line`` | ``blank_line``).
      text_field: the JSON key / Parquet column of the text.
      tokenizer: a SentencePiece ``.model``, a ``tokenizer.json`` or a directory with
        one; "" = train a SentencePiece model of ``vocab_size`` pieces on the corpus.
      vocab_size: pieces of that trained model.
      max_length: tokens per row.
      num_eval_rows: eval rows (-1: all).
      tokenized_dir: a prepared token store of the training documents ("" = none).
      masked: rows for a masked language model.
      mask_rate: the share of a row's tokens masked.
      max_predictions: masked positions per row, at most.
    """

    train_files: Any
    eval_files: Any
    document: str
    text_field: str
    tokenizer: str
    vocab_size: int
    max_length: int
    num_eval_rows: int
    tokenized_dir: str
    eval_holdout: float = 0.01
    train_on_prompts: bool = False
    masked: bool = False
    mask_rate: float = 0.15
    max_predictions: int = 20


def read_options(config: Any) -> LanguageOptions:
    """The language-model keys of the data section, checked.

    Raises:
      ConfigError: a key missing, or a value that cannot work.
    """
    keys = {
        "train_files": lambda v: v,
        "eval_files": lambda v: v,
        "document": str,
        "text_field": str,
        "tokenizer": lambda v: str(v or ""),
        "vocab_size": int,
        "max_length": int,
        "num_eval_rows": int,
        "tokenized_dir": lambda v: str(v or ""),
    }
    values = options.read(config, keys)
    if "eval_holdout" in config:  # runs recorded before the key existed hold out 1%
        values |= options.read(config, {"eval_holdout": float})
    if "train_on_prompts" in config:  # chat data
        values |= options.read(config, {"train_on_prompts": bool})
    if "masked" in config:
        values |= options.read(config, {"masked": bool, "mask_rate": float, "max_predictions": int})
    lm = LanguageOptions(**values)
    if not lm.eval_files and not 0 < lm.eval_holdout < 1:
        raise ConfigError(
            f"data.eval_holdout={lm.eval_holdout} must be between 0 and 1 (the share of "
            "data.train_files held out for evaluation), or give data.eval_files"
        )
    if lm.max_length < 2:
        raise ConfigError(f"data.max_length={lm.max_length} leaves no room for a target")
    if lm.masked and not 0 < lm.mask_rate < 1:
        raise ConfigError(f"data.mask_rate={lm.mask_rate} must be between 0 and 1")
    if lm.masked and lm.max_predictions < 1:
        raise ConfigError(f"data.max_predictions={lm.max_predictions} must be >= 1")
    return lm

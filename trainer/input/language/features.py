"""A model's features from rows of documents: a decoder's next-token targets, BERT's
masked tokens; and a training batch's rows of one process."""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer.input import order
from trainer.input.language.stream import fill_rows
from trainer.input.options import DataOptions

Batch = dict[str, np.ndarray]


def decoder_batch(
    tokens: np.ndarray,
    segments: np.ndarray,
    positions: np.ndarray,
    counted: np.ndarray | None = None,
) -> Batch:
    """A decoder's features from rows of ``L + 1`` tokens: each token's target is the
    next one, counted only inside its own document, and only where ``counted`` (bool
    [rows, L + 1], e.g. a conversation's answer tokens) says the target is learnt.

    The loss is the mean over the batch's counted targets (``weights`` summed over
    the global batch, as for pre-training): every answer token weighs the same, so a
    short answer counts for its few tokens, not for a row's or a conversation's share.
    """
    weights = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    if counted is not None:
        weights &= counted[:, 1:]
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segmentation": segments[:, :-1],
        "positions": positions[:, :-1],
        "weights": weights.astype(np.int32),
    }


@dataclasses.dataclass(frozen=True)
class Masking:
    """How a masked language model's rows are masked (picklable).

    Attributes:
      rate: the share of a row's maskable tokens masked.
      max_predictions: masked positions per row, at most.
      mask_id: the mask token; vocab_size: random replacements are drawn below it.
      special: ids never masked (BOS, EOS).
      seed: with the global row, seeds each row's choices.
    """

    rate: float
    max_predictions: int
    mask_id: int
    vocab_size: int
    special: tuple[int, ...]
    seed: int

    def __call__(self, rows: np.ndarray, tokens, segments, positions) -> Batch:
        """Masked features of global ``rows`` (their [rows, L] tokens, segments and
        positions): BERT's 80/10/10, drawn from a generator seeded by each row."""
        p = self.max_predictions
        inputs = tokens.copy()
        picked = np.zeros((len(rows), p), np.int32)
        ids = np.zeros((len(rows), p), np.int32)
        weights = np.zeros((len(rows), p), np.int32)
        for r, row in enumerate(rows.tolist()):
            rng = np.random.default_rng((self.seed, 1, row))
            maskable = np.flatnonzero((segments[r] > 0) & ~np.isin(tokens[r], self.special))
            count = min(p, max(1, int(round(self.rate * len(maskable))))) if len(maskable) else 0
            chosen = np.sort(rng.choice(maskable, size=count, replace=False))
            how = rng.random(count)
            replaced = rng.integers(0, self.vocab_size, size=count)
            picked[r, :count], ids[r, :count], weights[r, :count] = chosen, tokens[r, chosen], 1
            inputs[r, chosen] = np.where(
                how < 0.8, self.mask_id, np.where(how < 0.9, replaced, tokens[r, chosen])
            )
        return {
            "inputs": inputs,
            "segmentation": segments,
            "positions": positions,
            "masked_positions": picked,
            "masked_ids": ids,
            "masked_weights": weights,
        }


class TrainBatchFn:
    """This process's rows of a global training batch (picklable for worker processes)."""

    def __init__(self, documents, plan, opts: DataOptions, masking: Masking | None):
        self.documents, self.plan, self.opts, self.masking = documents, plan, opts, masking

    def __call__(self, batch_index: int) -> Batch:
        opts = self.opts
        rows = order.process_rows(
            batch_index, opts.global_batch, opts.process_index, opts.local_batch
        )
        return rows_batch(rows, self.plan, self.documents, self.masking)


def rows_batch(rows: np.ndarray, plan, documents, masking: Masking | None) -> Batch:
    """The features of global rows ``rows`` (all real rows) of ``plan`` (a
    :class:`~.stream.DocumentStream` or :class:`~.stream.PackedDocuments`); documents
    with loss masks
    (conversations: ``tokens_and_masks``) count only their masked tokens."""
    pieces = [plan.pieces(r) for r in rows.tolist()]
    needed = sorted({doc for row in pieces for doc, _, _ in row})
    masks = None
    if hasattr(documents, "tokens_and_masks"):
        pairs = documents.tokens_and_masks(needed)
        tokens = {d: ids for d, (ids, _) in zip(needed, pairs, strict=True)}
        masks = {d: mask for d, (_, mask) in zip(needed, pairs, strict=True)}
    else:
        tokens = dict(zip(needed, documents.tokens(needed), strict=True))
    *filled, counted = fill_rows(pieces, tokens, plan.row_tokens, masks)
    if masking is not None:
        return masking(rows, *filled)
    return decoder_batch(*filled, counted)

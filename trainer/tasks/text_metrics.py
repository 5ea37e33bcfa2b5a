"""Corpus metrics of generated text against references, summed across processes:
BLEU, chrF (sacrebleu's, from their sufficient statistics) and exact match; and a
few samples to show beside them.

BLEU is the geometric mean of 1- to 4-gram precisions: where most references are
shorter than four words, no 4-gram can match and BLEU is 0 however good the output
is. :func:`corpus_metrics` says so once (and chrF and exact match still mean
something there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sacrebleu
from jax.experimental import multihost_utils
from sacrebleu.metrics import CHRF

from trainer import console

# BLEU's highest n-gram order (sacrebleu's default, the one everyone reports).
_BLEU_ORDER = 4
_warned_short: set[str] = set()  # the tasks whose short references were said


def _statistics(hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """This process's sufficient statistics, float64: BLEU's (counts, totals, lengths),
    chrF's, exact matches, sentences, and references shorter than BLEU's order."""
    bleu = sacrebleu.BLEU().corpus_score(list(hypotheses), [list(references)])
    bleu_stats = [*bleu.counts, *bleu.totals, bleu.sys_len, bleu.ref_len]
    chrf = np.sum(
        np.asarray(CHRF()._extract_corpus_statistics(list(hypotheses), [list(references)])),
        axis=0,
    )
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True))
    short = sum(len(r.split()) < _BLEU_ORDER for r in references)
    return np.array([*bleu_stats, *chrf, exact, len(references), short], np.float64)


def corpus_metrics(
    hypotheses: Sequence[str], references: Sequence[str], *, what: str = "eval"
) -> dict[str, float]:
    """``{"bleu", "chrf", "exact_match"}`` of all processes' outputs together (every
    process calls it, with its own share; the statistics are summed, not the scores).

    Warns once per ``what`` when most references are shorter than four words: BLEU
    is then 0 by construction.
    """
    stats = _statistics(hypotheses, references)
    stats = np.asarray(multihost_utils.process_allgather(stats)).reshape(-1, stats.size).sum(0)
    bleu = [int(x) for x in stats[:10]]
    score = sacrebleu.BLEU.compute_bleu(bleu[:4], bleu[4:8], bleu[8], bleu[9]).score
    chrf = CHRF()._compute_score_from_stats([int(x) for x in stats[10:-3]]).score
    exact, sentences, short = stats[-3:]
    if short > sentences / 2 and what not in _warned_short:
        _warned_short.add(what)
        console.warn(
            f"{what}/bleu cannot mean much here: {short:.0f} of {sentences:.0f} references are "
            f"shorter than {_BLEU_ORDER} words, so no {_BLEU_ORDER}-gram can match and BLEU is "
            f"0 however good the output; read {what}/exact_match and {what}/chrf"
        )
    return {"bleu": score, "chrf": chrf, "exact_match": exact / max(sentences, 1.0)}


def samples(
    sources: Sequence[str], outputs: Sequence[str], references: Sequence[str], count: int = 3
) -> tuple[str, ...]:
    """The first ``count`` outputs as ``source => output (reference: ...)`` lines."""
    lines = []
    for source, output, reference in list(zip(sources, outputs, references, strict=False))[:count]:
        same = " (= reference)" if output.strip() == reference.strip() else ""
        lines.append(f"{source} => {output}{same or f' (reference: {reference})'}")
    return tuple(lines)

"""`tiny_translation`: a local, synthetic English -> toy-German TFDS dataset.

The corpus is generated from code (no download), deterministically from a fixed
seed, so every machine that prepares it gets the same examples in the same order
(the files' bytes may differ: protobuf map order is not fixed). It is small
enough for a small model to learn on CPU, and it is shaped like
`wmt14_translate/de-en` (a `Translation` feature with "de" and "en"), so the same
input pipeline serves both.

The toy language:
  * a lexicon of ~200 English words (determiners, adjectives, nouns, verbs,
    adverbs, prepositions, "and"), each mapped one-to-one to an invented
    target word (nouns capitalised, verbs ending in "t");
  * sentences of 3..12 words: one or two clauses joined by "and", each
    `subject verb [object] [preposition phrase] [adverb]`;
  * the translation is word-by-word plus two reordering rules that a model can
    only learn by attending across the sentence: adjectives follow their noun
    ("the big red dog" -> "DET Dog big red"), and the verb moves to the end of
    its clause ("the dog sees a cat" -> "DET Dog DET Cat sees").

Preparation writes array_record files with TFDS's own writer. That path does not
need TensorFlow: TFDS serialises examples with its vendored `tf.train.Example`
protos (`tensorflow_datasets.proto`) and writes them with `array_record`.
"""

import random
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds

from trainer.input.builders import base

DATASET_NAME = "tiny_translation"
NUM_TRAIN = 20_000
NUM_VALIDATION = 500
SEED = 20240613
MIN_WORDS = 3
MAX_WORDS = 12


def _words(text: str) -> tuple[str, ...]:
    """The words of `text` in order: the word tables below read as prose, a line per ~15."""
    return tuple(text.split())


_DETERMINERS = ("the", "a", "this", "that", "every", "some", "my", "your", "our", "their")
_ADJECTIVES = _words(
    """
    big small old young red blue green black white happy sad quick slow tall short quiet
    loud bright dark warm cold new good bad clever lazy brave shy strong weak rich poor
    clean dirty friendly angry hungry tired busy calm gentle proud kind strange famous
    """
)
_NOUNS = _words(
    """
    dog cat bird horse fish mouse cow sheep fox wolf bear lion rabbit duck goat frog man
    woman child teacher doctor farmer king queen student baker singer soldier sailor painter
    friend neighbor house garden river tree forest city village road bridge mountain lake
    field school market castle church table chair book letter window door bottle cup apple
    bread cake flower stone ship car train boat hat coat shoe lamp clock key box ball song
    picture map ring bell candle basket
    """
)
_VERBS = _words(
    """
    sees likes finds takes gives holds wants needs helps follows watches carries builds
    paints opens closes breaks cleans buys sells eats drinks reads writes loves hates visits
    calls meets pushes pulls throws catches hides brings moves draws knows forgets remembers
    answers teaches greets chases feeds
    """
)
_ADVERBS = _words(
    """
    today yesterday often quickly slowly quietly again always never soon here there
    """
)
_PREPOSITIONS = _words(
    """
    in on near under behind with without from beside above
    """
)
_CONJUNCTION = "and"

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "w", "z", "sch")
_NUCLEI = ("a", "e", "i", "o", "u", "ä", "ö", "ü", "ei", "au")
_CODAS = ("", "", "", "n", "r", "s", "l")


def verbs() -> frozenset[str]:
    """Returns the English verbs of the toy language (each clause has exactly one)."""
    return frozenset(_VERBS)


def _all_source_words() -> tuple[str, ...]:
    return _DETERMINERS + _ADJECTIVES + _NOUNS + _VERBS + _ADVERBS + _PREPOSITIONS + (_CONJUNCTION,)


def lexicon(seed: int = SEED) -> dict[str, str]:
    """Builds the one-to-one English -> toy-German word mapping.

    Args:
      seed: Seed of the invented target words; the dataset uses `SEED`.

    Returns:
      A fresh dict from every English word of the toy language to a unique target word.
    """
    rng = random.Random(seed)
    source_words = _all_source_words()
    # A target word must never equal a source word, or a copy model would look
    # like a translation model.
    taken = set(source_words)
    mapping = {}
    for word in source_words:
        while True:
            syllables = rng.choice((1, 2, 2))
            stem = "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
            if word in _NOUNS:
                stem = stem.capitalize()
            elif word in _VERBS:
                stem += "t"
            if stem not in taken:
                break
        taken.add(stem)
        mapping[word] = stem
    return mapping


def _noun_phrase(rng: random.Random) -> tuple[list[str], list[str]]:
    """Returns (English words, target-order English words) of `det adj* noun`."""
    det = rng.choice(_DETERMINERS)
    adjectives = [rng.choice(_ADJECTIVES) for _ in range(rng.choice((0, 0, 1, 1, 2)))]
    noun = rng.choice(_NOUNS)
    # Reordering rule 1: adjectives follow the noun in the target language.
    return [det, *adjectives, noun], [det, noun, *adjectives]


def _clause(rng: random.Random) -> tuple[list[str], list[str]]:
    """Returns (English words, target-order English words) of one clause."""
    subject, subject_t = _noun_phrase(rng)
    verb = rng.choice(_VERBS)
    obj, obj_t = _noun_phrase(rng) if rng.random() < 0.7 else ([], [])
    if rng.random() < 0.35:
        preposition = rng.choice(_PREPOSITIONS)
        np_words, np_t = _noun_phrase(rng)
        pp, pp_t = [preposition, *np_words], [preposition, *np_t]
    else:
        pp, pp_t = [], []
    adverb = [rng.choice(_ADVERBS)] if rng.random() < 0.3 else []
    # Reordering rule 2: the verb goes to the end of its clause.
    return (
        [*subject, verb, *obj, *pp, *adverb],
        [*subject_t, *obj_t, *pp_t, *adverb, verb],
    )


def _sentence(rng: random.Random) -> tuple[list[str], list[str]]:
    source, target = _clause(rng)
    if rng.random() < 0.2:
        source2, target2 = _clause(rng)
        source, target = source + [_CONJUNCTION] + source2, target + [_CONJUNCTION] + target2
    return source, target


def generate_pairs(num_pairs: int, seed: int = SEED) -> list[tuple[str, str]]:
    """Generates distinct (English, toy-German) sentence pairs deterministically.

    Args:
      num_pairs: Number of pairs; all English sentences are distinct.
      seed: Seed of both the lexicon and the sentence sampler.

    Returns:
      A list of `(en, de)` strings, words separated by single spaces.
    """
    words = lexicon(seed)
    rng = random.Random(seed + 1)
    seen = set()
    pairs = []
    while len(pairs) < num_pairs:
        source, target = _sentence(rng)
        if not MIN_WORDS <= len(source) <= MAX_WORDS:
            continue
        en = " ".join(source)
        # Distinct sentences keep the validation split disjoint from train.
        if en in seen:
            continue
        seen.add(en)
        pairs.append((en, " ".join(words[w] for w in target)))
    return pairs


class TinyTranslation(base.LocalBuilder):
    """Synthetic English -> toy-German translation, generated locally."""

    def features(self) -> tfds.features.FeatureConnector:
        return tfds.features.Translation(languages=("de", "en"))

    SUPERVISED_KEYS = ("en", "de")

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # Nothing to download.
        pairs = generate_pairs(NUM_TRAIN + NUM_VALIDATION)
        return {
            "train": self._generate_examples(pairs[:NUM_TRAIN]),
            "validation": self._generate_examples(pairs[NUM_TRAIN:]),
        }

    def _generate_examples(self, pairs: Sequence[tuple[str, str]]) -> Iterator:
        for index, (en, de) in enumerate(pairs):
            yield index, {"en": en, "de": de}


def prepare_tiny_translation(data_dir: str) -> None:
    """Builds `tiny_translation` under `data_dir` if missing (see `prepare_locally`)."""
    base.prepare_locally(TinyTranslation, data_dir)

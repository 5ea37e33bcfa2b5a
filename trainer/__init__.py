"""A training framework for JAX with weight-update sharding (Xu et al. 2020).

The commands are ``python -m trainer`` and its siblings (see the README). From
Python, a trained translation model::

    from trainer import Translator

    model = Translator.load("/tmp/demo")  # a run's work directory, or an export
    model.translate(["the big dog sees a cat"])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.inference.translator import Translator

__all__ = ["Translator"]


def __getattr__(name: str):
    # Imported on first use: every command starts from this package, and most of
    # them (their --help first) should not pay for importing JAX and Flax.
    if name == "Translator":
        from trainer.inference.translator import Translator  # noqa: PLC0415

        return Translator
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")

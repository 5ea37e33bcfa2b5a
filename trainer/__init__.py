"""A training framework for JAX with weight-update sharding (Xu et al. 2020).

The commands are ``python -m trainer`` and its siblings (see the README). From
Python, a trained translation model or language model::

    from trainer import Generator, Translator

    Translator.load("/tmp/demo").translate(["the big dog sees a cat"])
    Generator.load("/tmp/lm").generate(["the big dog sees a cat =>"])
"""

from __future__ import annotations

# typing.TYPE_CHECKING's value, without importing typing (4 ms): every command starts by
# importing this package, before its ``__main__`` can take a Ctrl-C.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from trainer.inference.generator import Generator
    from trainer.inference.translator import Translator

__all__ = ["Generator", "Translator"]


def __getattr__(name: str):
    # Imported on first use: every command starts from this package, and most of
    # them (their --help first) should not pay for importing JAX and Flax.
    if name == "Translator":
        from trainer.inference.translator import Translator  # noqa: PLC0415

        return Translator
    if name == "Generator":
        from trainer.inference.generator import Generator  # noqa: PLC0415

        return Generator
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")

"""The data commands: ``python -m trainer.data.prepare`` (a run's input, ahead) and
``python -m trainer.data.bench`` (the input pipeline alone, timed). The pipelines
themselves are :mod:`trainer.input`."""

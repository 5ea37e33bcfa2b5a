"""Learning-rate schedules against their formulas, written out by hand."""

import math

import numpy as np
import pytest

from configs import common
from trainer.errors import ConfigError
from trainer.training import optimizers

PEAK, WARMUP, STEPS = 0.5, 10, 110


def schedule(name, warmup=WARMUP, **extra):
    config = common.base_config().optimizer
    config.update(schedule=name, learning_rate=PEAK, warmup_steps=warmup, **extra)
    return optimizers.make_schedule(config, STEPS)


def expected(name, step, warmup=WARMUP, end=0.0, power=2.0):
    if step < warmup:
        return PEAK * step / warmup
    t = step - warmup  # steps since the end of the warm-up
    decay_steps = STEPS - warmup
    if name == "constant":
        return PEAK
    if name == "rsqrt":  # Vaswani et al.: peak at the warm-up's end, then 1/sqrt(step)
        return PEAK * math.sqrt(max(warmup, 1) / max(t + warmup, 1))
    if name == "cosine":
        return PEAK * 0.5 * (1 + math.cos(math.pi * min(t, decay_steps) / decay_steps))
    if name == "polynomial":
        frac = 1 - min(t, decay_steps) / decay_steps
        return (PEAK - end) * frac**power + end
    raise AssertionError(name)


@pytest.mark.parametrize("name", optimizers.SCHEDULES)
@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_schedule_matches_its_formula(name, warmup):
    extra = {"end_learning_rate": 0.01, "power": 1.5} if name == "polynomial" else {}
    fn = schedule(name, warmup, **extra)
    kw = {"end": 0.01, "power": 1.5} if name == "polynomial" else {}
    for step in (0, 1, 5, 9, 10, 11, 40, 109, 110, 200):
        want = expected(name, step, warmup, **kw)
        np.testing.assert_allclose(float(fn(step)), want, rtol=1e-5, atol=1e-7, err_msg=f"{step}")


def test_warmup_reaches_the_peak_at_its_end():
    for name in optimizers.SCHEDULES:
        assert float(schedule(name)(WARMUP)) == pytest.approx(PEAK, rel=1e-6), name


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer.schedule must be one of"):
        schedule("linear")


def test_warmup_steps_of_the_user_win_over_a_presets_ratio():
    # Hugging Face's Trainer: warmup_steps, where set, overrides warmup_ratio.
    config = common.base_config().optimizer
    config.update(schedule="cosine", warmup_steps=0, warmup_ratio=0.03)
    assert optimizers.warmup_steps(config, 1_000) == 30
    config.warmup_steps = 5
    assert optimizers.warmup_steps(config, 1_000) == 5
    sched = optimizers.make_schedule(config, 1_000)
    assert float(sched(5)) == pytest.approx(config.learning_rate)

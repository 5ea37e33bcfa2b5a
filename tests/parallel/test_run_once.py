"""The programs a run executes once compile at LLVM level 1 on CPU (trainer/parallel/run_once.py):
the option as chosen, and that it reaches both programs' compiles."""

import jax
import pytest
from conftest import tiny_wus, tpu_devices

from trainer.parallel import run_once
from trainer.training import experiment

# The suite's own XLA_FLAGS set a level (tests/conftest.py); a user's usually do not.
WITHOUT_LEVEL = "--xla_force_host_platform_device_count=8"


def test_cpu_programs_run_once_at_level_1_unless_xla_flags_set_a_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", WITHOUT_LEVEL)
    assert run_once.options(jax.devices()) == {"xla_backend_optimization_level": 1}
    monkeypatch.delenv("XLA_FLAGS")
    assert run_once.options(jax.devices()[:1]) == {"xla_backend_optimization_level": 1}
    monkeypatch.setenv("XLA_FLAGS", f"{WITHOUT_LEVEL} --xla_backend_optimization_level=0")
    assert run_once.options(jax.devices()) is None


def test_tpu_programs_compile_with_the_defaults(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", WITHOUT_LEVEL)
    assert run_once.options(tpu_devices("v5e:2x2")) is None


@pytest.mark.parametrize("program", ["layout check", "init"])
def test_the_layout_check_and_the_init_compile_with_the_options(program, monkeypatch):
    """An option XLA does not know, handed to one of the two programs, fails its compile:
    so the options reach it. The layout check runs on one CPU device, the init on the
    mesh's 8."""

    def options(devices):
        ours = len(list(devices)) == (1 if program == "layout check" else 8)
        return {"xla_no_such_option_for_the_test": 1} if ours else None

    monkeypatch.setattr(run_once, "options", options)
    config = tiny_wus("wus")
    if program == "layout check":
        with pytest.raises(Exception, match="no_such_option_for_the_test"):
            experiment.build(config)
    else:
        exp = experiment.build(config)
        with pytest.raises(Exception, match="no_such_option_for_the_test"):
            exp.init()

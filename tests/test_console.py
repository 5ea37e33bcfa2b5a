"""What the commands say: progress as bars on a terminal and plain lines elsewhere,
--help on every command, the config listing and the config block."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, command_env, run_command

from configs import transformer_1024
from trainer import console
from trainer.command import cli


@pytest.fixture
def plain(monkeypatch):
    """The console into a buffer, as in a log file; restored afterwards."""
    out = io.StringIO()
    console.setup(stream=out, interactive=False)
    yield out
    console.setup()


def test_plain_progress_says_long_work_and_skips_quick_work(plain, monkeypatch):
    for _ in console.progress(range(3), desc="quick", unit="batches"):
        pass
    assert plain.getvalue() == ""  # quick work leaves no trace between step lines
    monkeypatch.setattr(console, "PLAIN_EVERY_S", 0.0)
    with console.progress(total=4, desc="translating", unit="sentences") as progress:
        progress.update(3)
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("translating: 3/4 sentences (")
    assert lines[-1].startswith("translating: 3 sentences in ")
    assert "\r" not in plain.getvalue()


def test_phase_says_start_and_end_and_nothing_after_an_error(plain):
    with console.phase("compiling a loop of 20 steps", done="compiled") as phase:
        pass
    with pytest.raises(ValueError), console.phase("reading the checkpoint"):
        raise ValueError("unreadable")
    lines = plain.getvalue().splitlines()
    assert lines[0] == "compiling a loop of 20 steps ..."
    assert re.fullmatch(r"compiling a loop of 20 steps: compiled in \d+\.\ds", lines[1])
    assert lines[2:] == ["reading the checkpoint ..."]  # the error says the rest
    assert phase.seconds >= 0


def test_other_processes_say_nothing(plain):
    console.setup(stream=plain, interactive=False, enabled=False)
    console.say("hello")
    with console.phase("compiling"):
        pass
    assert plain.getvalue() == ""


def test_interactive_progress_is_a_bar_that_goes():
    out = io.StringIO()
    console.setup(stream=out, interactive=True)
    try:
        for _ in console.progress(range(5), desc="evaluating", unit="batches"):
            pass
    finally:
        console.setup()
    text = out.getvalue()
    assert text.startswith("\revaluating:   0%|") and "0/5 [" in text  # a tqdm bar
    assert text.endswith(" " * 20 + "\r")  # and erased when done


def test_duration():
    assert console.duration(3.21) == "3.2s"
    assert console.duration(75) == "1m15s"
    assert console.duration(3725) == "1h02m"


def _under_pty(command: list[str], timeout: float = 300) -> tuple[int, str]:
    """Runs ``command`` with a pseudo-terminal as its stdout and stderr (as in a
    user's terminal); returns its exit code and everything it wrote."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        command, cwd=REPO, env=command_env(), stdout=follower, stderr=follower, close_fds=True
    )
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], timeout)
        if not ready:
            process.kill()
            raise TimeoutError(" ".join(command))
        try:
            data = os.read(leader, 65536)
        except OSError:  # the pty closes when the process ends
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return process.wait(), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # a run on a pseudo-terminal: ~18 s
def test_a_terminal_gets_bars_and_a_log_gets_plain_lines(tmp_path):
    # Generating the embedded dataset and training its vocabulary: the phases of a
    # first run, through the command that does them ahead.
    def prepare(data_dir):
        return [
            sys.executable,
            "-m",
            "trainer.data.prepare",
            "--config=configs/transformer_1024.py:tiny",
            f"--config.data.data_dir={data_dir}",
        ]

    code, terminal = _under_pty(prepare(tmp_path / "a"))
    assert code == 0, terminal[-3000:]
    logged = run_command(prepare(tmp_path / "b"))
    assert logged.returncode == 0, logged.stderr[-3000:]

    # On the terminal, each phase's clock is redrawn in place (carriage returns).
    assert "\r" in terminal and "generating the dataset tiny_translation" in terminal
    # In the log: whole lines, no redraws, no bars; each phase as it starts and ends.
    text = logged.stdout + logged.stderr
    assert "\r" not in text and "%|" not in text
    lines = logged.stdout.splitlines()
    start = f"generating the dataset tiny_translation (once) into {tmp_path / 'b'} ..."
    assert start in lines
    assert any(re.match(r"generating the dataset .*: done in \d", line) for line in lines)
    assert any(re.match(r"training a 384-piece vocabulary .*: done in \d", line) for line in lines)
    # TFDS's own "Downloading and preparing" and absl's W/I lines are gone.
    assert "Downloading" not in text and not re.search(r"^[WI]\d{4} ", text, re.M)
    assert logged.stderr == ""


COMMANDS = [
    "trainer",
    "trainer.evaluate",
    "trainer.translate",
    "trainer.export",
    "trainer.plot",
    "trainer.bench",
    "trainer.aot",
    "trainer.data.bench",
    "trainer.data.prepare",
    "trainer.generate",
]
# Each --help is a process that imports JAX (~4 s): the slow suite reads the others'.
DEFAULT_HELP = ("trainer", "trainer.export", "trainer.generate")


@pytest.mark.parametrize(
    "module",
    [pytest.param(m, marks=[] if m in DEFAULT_HELP else [pytest.mark.slow]) for m in COMMANDS],
)
def test_help_is_plain_and_ends_with_an_example(module):
    result = run_command([sys.executable, "-m", module, "--help"], timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"usage: python -m {module} ")
    assert "``" not in text and ":func:" not in text and ":mod:" not in text
    assert REPO not in text  # no absolute module path
    assert "(default: 'None')" not in text
    lines = text.rstrip().splitlines()
    examples = lines[lines.index("example:") + 1 :]
    assert examples and all(line.startswith(f"  python -m {module} ") for line in examples)


def test_only_commands_that_write_events_load_tensorboardx_and_none_loads_torch():
    # tensorboardX imports torch where it is installed (it is, with the test extra):
    # 3.2 s of every start. torch imports as usual afterwards.
    code = (
        "import sys; from trainer.command import process; import trainer.export; "
        "heavy = lambda: sorted({'tensorboardX', 'torch'} & set(sys.modules)); "
        "process.setup(); print(heavy()); process.setup(writes_events=True); print(heavy()); "
        "import torch; print(heavy())"
    )
    result = run_command([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["[]", "['tensorboardX']", "['tensorboardX', 'torch']"]


@pytest.mark.parametrize("module", ["launch.local", "launch.gcs_emulator", "launch.bench"])
def test_launch_help_documents_every_flag(module):
    result = run_command([sys.executable, "-m", module, "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    flags = re.findall(r"^  (--\w+)( \w+)?\n?\s*(\S.*)?$", result.stdout, re.M)
    assert flags and all(help_text for _, _, help_text in flags), result.stdout
    assert "example: python -m " + module in " ".join(result.stdout.split())


def test_list_configs_names_every_config_and_variant():
    result = run_command([sys.executable, "-m", "trainer", "--list_configs"], timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("ncf_16", "resnet50_16", "resnet50_1024", "transformer_16", "transformer_1024"):
        assert f"  configs/{name}.py" in result.stdout
    for variant in transformer_1024.VARIANTS:
        assert f":{variant} " in result.stdout


def test_config_block_shows_what_differs_from_the_file():
    config = transformer_1024.get_config("tiny")
    config.num_train_steps = 7
    block = cli.describe_config(config, "configs/transformer_1024.py:tiny").splitlines()
    defaults = transformer_1024.get_config()
    assert block[0].startswith("config configs/transformer_1024.py:tiny: ")
    body = " ".join(block[1:]).split()
    assert "num_train_steps=7" in body and "model.emb_dim=64" in body
    assert f"global_batch_size={config.global_batch_size}" in body
    assert not any(item.startswith("model.share_embeddings=") for item in body)  # unchanged
    assert defaults.num_train_steps != 7


def test_a_long_phase_in_a_log_says_it_is_alive(plain, monkeypatch):
    monkeypatch.setattr(console, "PLAIN_EVERY_S", 0.05)
    with console.phase("compiling a loop of 20 steps", done="compiled"):
        time.sleep(0.3)
    lines = plain.getvalue().splitlines()
    alive = [line for line in lines[1:-1] if re.fullmatch(r"compiling .* \.\.\. 0\.\ds", line)]
    assert len(alive) >= 2, lines
    assert lines[-1].startswith("compiling a loop of 20 steps: compiled in ")


def test_the_step_line_is_drawn_on_a_terminal_and_absent_from_a_log(plain):
    line = console.StepLine(step=100, total=600)
    line.update(120)
    line.close()
    assert plain.getvalue() == ""  # a log gets the log lines only
    out = io.StringIO()
    console.setup(stream=out, interactive=True)
    try:
        line = console.StepLine(step=100, total=600)
        time.sleep(0.05)
        line.update(120)
        line.close()
    finally:
        console.setup()
    text = out.getvalue()
    assert "step 120/600 | " in text and " steps/s | ETA " in text
    assert text.endswith("\r")  # erased when the run ends


def test_the_launcher_drops_gloo_lines_and_speaks_when_quiet(monkeypatch):
    from launch import local

    # As they reached the console of a 2-process run, pieces and all.
    for noise in (
        "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks "
        "is : 7",
        "[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
        "peer ranks is : 1",
        "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        " 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        "[Gloo] Rank ",
    ):
        assert local.is_gloo_noise(noise), noise
    for line in ("step     100/600 | loss 2.1 | ETA 1m", "error: the peer ranks disagree"):
        assert not local.is_gloo_noise(line)

    out = io.StringIO()
    output = local._Output(out)
    output.pump("[p0]", io.StringIO("[Gloo] Rank 0 is connected to 1 peer ranks.\nstep 4\n"))
    assert out.getvalue() == "[p0] step 4\n"
    monkeypatch.setattr(local, "QUIET_S", 0.0)

    class Running:
        def poll(self):
            return None

    done = threading.Event()
    beat = threading.Thread(target=output.heartbeat, args=([Running(), Running()], done))
    beat.start()
    time.sleep(1.5)
    done.set()
    beat.join()
    assert "[launch] 2 of 2 processes running, " in out.getvalue()


@pytest.mark.slow  # ~11 s
def test_bench_plan_prints_the_plan_and_times_nothing():
    # What the README sends users to for parameter names: seconds, not minutes.
    command = [sys.executable, "-m", "trainer.bench", "--config=configs/transformer_1024.py:tiny"]
    result = run_command([*command, "--cpu_devices=8", "--plan", "--modes=none,wus"], timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "none: group = 8 cpu devices in device order (no torus); 1 group"
    header = next(line for line in lines if line.strip().startswith("parameter"))
    assert header.split() == ["parameter", "shape", "none", "wus"]
    row = next(line for line in lines if line.strip().startswith("decoder_layers/mlp/wi/kernel"))
    assert "replicated (one shard)" in row and "over data" in row
    assert "compil" not in result.stdout + result.stderr and "timed" not in result.stdout

"""A run's config read back by the commands that work on a finished run: config.json,
or, where that is damaged, the copy its newest checkpoint keeps."""

import json

import pytest

from configs import transformer_1024
from trainer.errors import UserError
from trainer.workdir import run_config


def test_a_damaged_config_falls_back_to_the_newest_checkpoints_copy(tmp_path, capsys):
    config = transformer_1024.get_config("tiny")
    text = config.to_json_best_effort()
    (tmp_path / "config.json").write_text(text[:100])  # cut short
    with pytest.raises(UserError, match=r"config.json is damaged \(JSONDecodeError: .*no checkpo"):
        run_config.load(str(tmp_path))
    for step, content in ((20, text.replace('"seed": 0', '"seed": 20')), (40, "{cut")):
        copy = tmp_path / "checkpoints" / str(step) / "config" / run_config.CHECKPOINT_CONFIG_FILE
        copy.parent.mkdir(parents=True)
        copy.write_text(content)
    loaded = run_config.load(str(tmp_path))
    assert loaded.seed == 20  # 40's own copy is damaged too: the newest readable one
    assert loaded.to_dict() == {**config.to_dict(), "seed": 20}
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: {tmp_path}/config.json is damaged (JSONDecodeError: ")
    assert warning.endswith(
        "using the config saved with checkpoint 20; the next training run in "
        "this directory writes the file anew"
    )
    run_config.load(str(tmp_path), warn=False)
    assert not capsys.readouterr().err


@pytest.mark.parametrize("text", ["42", "[]", '"a"', "\udcff"])
def test_only_a_json_object_is_a_config(text, tmp_path):
    (tmp_path / "config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(UserError, match="config.json is damaged"):
        run_config.load(str(tmp_path))


def test_keys_added_since_the_run_take_their_defaults():
    config = json.loads(transformer_1024.get_config("tiny").to_json_best_effort())
    del config["eval_dtype"]
    assert run_config.from_json(json.dumps(config)).eval_dtype == "float32"

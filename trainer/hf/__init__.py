"""Hugging Face checkpoints in and out: a model directory's ``config.json`` as our model
config and back (:mod:`trainer.hf_config`, on the ground floor: config files read
it), its tensor names and layouts as ours and back
(:mod:`.names`), its ``*.safetensors`` files read a tensor at a time and written in
shards (:mod:`.safetensors`), and the parameters placed straight into a run's
shardings (:mod:`.checkpoint`)."""

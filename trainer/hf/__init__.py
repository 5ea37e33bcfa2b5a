"""Hugging Face checkpoints in and out: a model directory's ``config.json`` as our model
config and back (:mod:`.config`, which config files read: it imports no JAX), its
tensor names and layouts as ours and back (:mod:`.names`), its ``*.safetensors`` files
read a tensor at a time, checked, and written in shards (:mod:`.safetensors_files`), a
run's tokenizer as its files (:mod:`.tokenizer_files`), and the parameters placed
straight into a run's shardings (:mod:`.checkpoint`)."""

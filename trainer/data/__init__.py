"""Input pipelines: TFDS datasets read through `tfds.data_source` + grain, without TensorFlow."""

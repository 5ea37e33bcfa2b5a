"""Input pipelines: TFDS datasets (and the embedded ones, builders/) read through
tfds.data_source + grain, in one global order, each process its share."""

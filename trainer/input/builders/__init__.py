"""The embedded datasets, generated locally as TFDS builders (nothing is downloaded):
the ``:tiny`` variants' data and full-size local stand-ins for ImageNet and MovieLens."""

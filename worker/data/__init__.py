"""Data readers: the synthetic click log, Criteo-format files and Parquet, streamed in batches."""

from tether.common.moved import forward_names

# The names of the old module ``tether.worker.data``, until tether 0.2 (with a DeprecationWarning).
__getattr__ = forward_names(__name__)

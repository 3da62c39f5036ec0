"""The client over all shards (push, pull, push_pull, wait), its routing, channels and results, and local mode's in-process client."""

from tether.common.moved import forward_names

# The names of the old module ``tether.worker.client``, until tether 0.2 (with a DeprecationWarning).
__getattr__ = forward_names(__name__)

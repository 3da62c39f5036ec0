"""The training loop: Trainer, one step in pieces, a policy per consistency mode, the sharded modules and what a run records."""

from tether.common.moved import forward_names

# The names of the old module ``tether.worker.training``, until tether 0.2 (with a DeprecationWarning).
__getattr__ = forward_names(__name__)

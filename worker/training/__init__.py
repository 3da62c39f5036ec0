"""The training loop: Trainer, one step in pieces, a policy per consistency mode, the sharded modules and what a run records."""

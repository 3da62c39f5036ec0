"""A shard's checkpoints: when they are taken, their files, and which one a starting shard restores."""

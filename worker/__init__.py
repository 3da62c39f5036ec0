"""tether worker: client over all shards, sharded PyTorch modules, training loop."""

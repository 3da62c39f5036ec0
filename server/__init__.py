"""tether shard: embedding and dense parameter storage, server-side optimizers, gRPC service."""

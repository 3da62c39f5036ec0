"""tether shard: the request handler behind gRPC and the data plane, parameter storage, clocks, checkpoints."""

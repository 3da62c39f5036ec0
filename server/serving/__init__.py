"""How a shard is reached: start-up, the gRPC servicer, the request handler, the data plane and its connections, token checks."""

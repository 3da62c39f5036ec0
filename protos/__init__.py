"""tether contract, shared by shards and workers: the .proto and its stubs, specs, update rules, codec, errors, partition."""

"""tether wire contract: the .proto, generated stubs, tensor codec, error table, partition function."""

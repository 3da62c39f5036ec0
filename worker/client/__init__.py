"""The client over all shards (push, pull, push_pull, wait), its routing, channels and results, and local mode's in-process client."""

"""What a shard holds: embedding tables and their id index, dense chunks, admission, update logs,
clocks and leases, exactly-once records, and the shard's declare/pull/push over them."""

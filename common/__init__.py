"""Process helpers shared by shards, workers and the launcher: config declarations
(``settings``) and the torch-free names they choose from (``choices``), command-line help
(``cli_args``), TLS and tokens (``security``), the metrics HTTP server (``metrics_http``) and
malloc tuning (``allocator``). Not part of the wire contract (that is ``tether.protos``)."""

"""Process helpers shared by shards, workers and the launcher: config declarations
(``settings``), command-line help (``cli_args``), TLS and tokens (``security``), the metrics HTTP
server (``metrics_http``) and malloc tuning (``allocator``). Not part of the wire contract
(that is ``tether.protos``)."""

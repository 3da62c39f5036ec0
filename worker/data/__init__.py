"""Data readers: the synthetic click log, Criteo-format files and Parquet, streamed in batches."""

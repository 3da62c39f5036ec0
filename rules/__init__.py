"""The maths shards, worker caches and local mode share: update rules in torch and compiled form,
initial rows, a push's hooks, the compiled kernels and their disk cache."""

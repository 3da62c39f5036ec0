"""The shard flags of ``tether launch``, which it gives every shard of its local cluster (in each
shard's config file), made from ``ShardConfig``'s declarations (``tether.common.settings``): a
field declared there is a launch flag too, unless it is one of ``LAUNCHER_SET``, which the
launcher sets per shard or itself, or which would need the workers told as well."""

from __future__ import annotations

import argparse

from tether.common import settings as fields
from tether.server.config import ShardConfig

__all__ = ["LAUNCHER_SET", "add_shard_flags", "shard_config"]

# ShardConfig fields that are not launch flags: each shard's own address, ports and files, its
# index and the count (the launcher gives them), its metrics port (--metrics), checkpoints (under
# --out, with the launcher's --checkpoint-every or the workers' --checkpoint-every-steps), and TLS and tokens (the workers would need
# their side of them too).
LAUNCHER_SET = (
    "host", "port", "shard_index", "num_shards", "metrics_port", "port_file", "health_port", "data_port",
    "checkpoint_dir", "checkpoint_every_s", "tls_cert", "tls_key", "tls_client_ca", "auth_token_file",
)


def add_shard_flags(parser: argparse.ArgumentParser) -> None:
    """The shard flags, in their own section of ``parser``'s help."""
    group = parser.add_argument_group(
        "shard flags", "given to every shard of the cluster, as 'tether server' takes them (each falls back to its TETHER_* variable)"
    )
    fields.add_flags(group, ShardConfig, exclude=LAUNCHER_SET)


def shard_config(namespace: argparse.Namespace) -> ShardConfig:
    """Every shard's config from the parsed shard flags (all of them: what the launcher's
    environment set included); the fields of ``LAUNCHER_SET`` at their defaults, for the launcher
    to set (``LocalCluster.start_shards``).

    Raises:
        ValueError: a value the shard would refuse, named as ``tether server`` names it.
    """
    return ShardConfig(**fields.values_from_args(ShardConfig, namespace, exclude=LAUNCHER_SET))

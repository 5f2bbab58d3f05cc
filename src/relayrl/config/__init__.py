"""The run config's schema: one leaf module per section, composed by :mod:`relayrl.config.run`.

The run config is a contract between the services, like the protobuf messages: the rollout service reads the
addresses of inference, reward and trainer, the trainer reads the staleness bound and the dataset. So its schema
lives here, outside every service package, and each section module imports only the standard library, PyYAML and
:mod:`relayrl.config.typed` (no torch, no gRPC, no service logic); enums live beside the section that owns them.
Each service owns the meaning of its section; services never import one another.
"""

from relayrl.config.run import MIGRATIONS, SCHEMA_VERSION, RunConfig, dump_run_config, load_run_config, migrate

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "RunConfig", "dump_run_config", "load_run_config", "migrate"]

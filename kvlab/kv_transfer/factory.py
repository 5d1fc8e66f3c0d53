"""Build a connector by name for one role (vLLM: KVConnectorFactory,
vllm/distributed/kv_transfer/kv_connector/factory.py)."""

from __future__ import annotations

from kvlab.kv_transfer.base import KVConnectorBase, KVConnectorRole


def create_connector(transfer_config, role: KVConnectorRole, block_size: int,
                     block_bytes: int) -> KVConnectorBase:
    if transfer_config.kv_connector == "OffloadingConnector":
        from kvlab.kv_transfer.offloading_connector import OffloadingConnector as cls
    else:
        from kvlab.kv_transfer.example_connector import ExampleConnector as cls
    return cls(transfer_config, role, block_size, block_bytes)

"""KV beyond the pool (chapter 10): vLLM's KV connector interface and two connectors.

- `base.py`: the connector interface, with vLLM 0.33.0's hook names and roles
  (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`).
- `config.py`: `KVTransferConfig` (vLLM's `--kv-transfer-config`) and how `kv_offloading_size`
  turns into one, as `VllmConfig` does.
- `tier.py`: where blocks go: a file of fixed slots (the offloading tier) or a folder of
  files one per block (shared between two processes).
- `offloading_connector.py`: native offloading: a bounded second tier with an LRU index, full
  prompt blocks stored step by step, asynchronous loads (`OffloadingConnector`).
- `example_connector.py`: a folder shared by two engines, for disaggregated prefill
  (`ExampleConnector`, after vLLM's connector of that name).
"""

from kvlab.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                    KVConnectorRole)
from kvlab.kv_transfer.kv_transfer_config import KVTransferConfig
from kvlab.kv_transfer.factory import create_connector

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "KVTransferConfig", "create_connector"]

"""`KVTransferConfig`: which connector an engine runs, in vLLM 0.33.0's fields
(`vllm/config/kv_transfer.py`), and the offloading knobs that fill one in
(`VllmConfig._post_init_kv_transfer_config`, `vllm/config/vllm.py`)."""

from __future__ import annotations

import dataclasses
import math
import numbers

CONNECTORS = ("OffloadingConnector", "ExampleConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
OFFLOADING_BACKENDS = ("native", "lmcache")


@dataclasses.dataclass
class KVTransferConfig:
    """vLLM's `--kv-transfer-config` fields that kvlab reads.

    kv_connector: the class ("OffloadingConnector" or "ExampleConnector" here); None, vLLM's
        default, runs none (unless kv_offloading_size fills it in).
    kv_role: "kv_producer" stores and never loads, "kv_consumer" loads and never stores,
        "kv_both" does both (vLLM's offloading always runs as kv_both).
    kv_connector_extra_config: the connector's own settings. OffloadingConnector reads
        "cpu_bytes_to_use" (the tier's bytes, vLLM's key) and "storage_path" (kvlab-only: the
        folder its file goes in; default the system's temporary folder); ExampleConnector
        reads "shared_storage_path" (vLLM's key).
    kv_load_failure_policy: vLLM's: "fail" (its default) ends a request whose load failed with
        an error; "recompute" computes the tokens that did not arrive.
    """

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector={self.kv_connector!r}: kvlab has {CONNECTORS} "
                             "(vLLM's NIXL, LMCache and Mooncake connectors need their own "
                             "libraries and a GPU)")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role={self.kv_role!r}: must be one of {KV_ROLES}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy={self.kv_load_failure_policy!r}: must be "
                             f"one of {LOAD_FAILURE_POLICIES}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise TypeError("kv_connector_extra_config must be a dict")

    def check_connector(self) -> None:
        """What the named connector itself needs (checked once kv_offloading_size has filled
        the config in, as vLLM's VllmConfig does before it builds the connector)."""
        if self.kv_connector == "OffloadingConnector":
            size = self.kv_connector_extra_config.get("cpu_bytes_to_use")
            if (isinstance(size, bool) or not isinstance(size, numbers.Real)
                    or not math.isfinite(size) or not size > 0):
                raise ValueError("OffloadingConnector needs kv_connector_extra_config"
                                 f"['cpu_bytes_to_use'] > 0 (the tier's bytes), got {size!r}")
        if self.kv_connector == "ExampleConnector":
            path = self.kv_connector_extra_config.get("shared_storage_path")
            if not isinstance(path, str) or not path:
                raise ValueError("ExampleConnector needs kv_connector_extra_config"
                                 "['shared_storage_path'], the folder both engines share")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def coerce(cls, value) -> "KVTransferConfig | None":
        """A KVTransferConfig from itself, a dict of its fields (as `--kv-transfer-config`'s
        JSON gives), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"kv_transfer_config: unknown fields {sorted(unknown)}")
            return cls(**value)
        raise TypeError(f"kv_transfer_config must be a KVTransferConfig or a dict, got "
                        f"{type(value).__name__}")


def offloading_transfer_config(kv_offloading_size: float | None, kv_offloading_backend: str,
                               kv_transfer_config) -> KVTransferConfig | None:
    """The connector an engine runs, as vLLM 0.33.0 derives it: `kv_offloading_size` (GiB)
    with the "native" backend becomes the OffloadingConnector with
    cpu_bytes_to_use = size * 2**30 and kv_role "kv_both"; without it the given config (or
    none) stands."""
    if kv_offloading_backend not in OFFLOADING_BACKENDS:
        raise ValueError(f"kv_offloading_backend={kv_offloading_backend!r}: must be one of "
                         f"{OFFLOADING_BACKENDS}")
    config = KVTransferConfig.coerce(kv_transfer_config)
    if kv_offloading_size is None:
        if config is None or config.kv_connector is None:
            return None  # vLLM: a transfer config that names no connector runs none
        config.check_connector()
        return config
    if (isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, numbers.Real)
            or not math.isfinite(kv_offloading_size) or not kv_offloading_size > 0):
        raise ValueError(f"kv_offloading_size is the tier's size in GiB, > 0; got "
                         f"{kv_offloading_size!r}")
    if kv_offloading_backend == "lmcache":
        raise ValueError("kv_offloading_backend='lmcache' needs LMCache's server (vLLM starts "
                         "its LMCacheMPConnector); kvlab runs the 'native' backend only")
    if config is not None and config.kv_connector not in (None, "OffloadingConnector"):
        raise ValueError(f"kv_offloading_size and kv_transfer_config's {config.kv_connector} "
                         "both name a connector: pass one of them")
    extra = dict(config.kv_connector_extra_config) if config is not None else {}
    extra["cpu_bytes_to_use"] = int(kv_offloading_size * (1 << 30))
    config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra,
        kv_load_failure_policy=(config.kv_load_failure_policy if config is not None
                                else "fail"))
    config.check_connector()
    return config

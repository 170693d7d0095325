"""KV tiers below the block pool: the tiered store the engine drives (store.py, behind the
engine's interface in hearth/engine/kv/store_api.py), host-memory and directory tiers, the
Mooncake Store tier and the block-record file format they share."""

"""The engine's KV cache: block hashes, the block pool and prefix cache, the per-request cache
manager, and the engine's halves of PD transfer (transfer_api.py: the interface; transfer.py: the
engine side) and of the KV tiers (store_api.py, tiers.py). Their drivers live above the engine,
in hearth/kv_transfer and hearth/kv_tiers."""

"""Prefill/decode KV transfer: the connector a worker's engine drives (connector.py, behind the
engine's interface in hearth/engine/kv/transfer_api.py), the KV descriptor checks, leases on the
prefill side, peer allow-lists, the wire format and its transports (TCP, Mooncake)."""

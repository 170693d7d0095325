"""One layer's attention call as a model makes it, for tests over hand-made caches: this step's
K/V into the cache through the backend, then the backend's attention."""

from hearth.ops.attention_backends import AttentionBackend, TorchAttentionBackend

TORCH = TorchAttentionBackend()


def paged_attention(q, k, v, k_cache, v_cache, meta, scale: float,
                    backend: AttentionBackend = TORCH):
    """[T, H, D] queries and this step's [T, KVH, D] K/V -> [T, H, D]."""
    backend.write_kv(k, v, k_cache, v_cache, meta)
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale)

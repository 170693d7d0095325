"""Frozen configuration dataclasses, one per concern.

Each component receives only the part it needs. Facts learned at run time (the number of KV
blocks, the model's shape) are constructor arguments elsewhere, never written back here.
CLI flags map onto these (and back onto a worker's command line, for `hearth up`) in exactly
one place: `hearth/flags/`. The HTTP server's and the router's own configs sit beside their
layers (`hearth/server/server_config.py`, `hearth/router/router_config.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


DEFAULT_MODEL = "smollm2-135m-instruct"


class Role(enum.StrEnum):
    """What a worker does in prefill/decode disaggregation; also what one hop asks of a worker
    (a request's `KVTransfer.role` is PREFILL or DECODE, never BOTH). A `str`, so it compares,
    prints and encodes (JSON, msgpack, Prometheus labels) as its value."""

    BOTH = "both"  # monolithic: prefills and decodes its own requests
    PREFILL = "prefill"  # runs prompts, exports their KV under a lease
    DECODE = "decode"  # imports a prompt's KV, then decodes

    @classmethod
    def parse(cls, value: object, what: str = "role") -> "Role":
        """`value` as a Role; ValueError naming `what` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(r.value for r in cls)
            raise ValueError(f"{what}: {value!r} is not one of {choices}") from None


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL  # HF folder, GGUF file, or a built-in name
    dtype: str = "float32"  # float32 (exact reference) | bfloat16 | float16
    # Decode-path weights (hearth/models/quant.py): none | gguf (the file's own blocks) | q8_0 |
    # auto (gguf for a GGUF file when the CPU kernels run here, else none).
    quantization: str = "auto"
    cpu_kernels: str = "auto"  # auto (best build that runs here) | avx512 | avx2 | off
    # A directory for a GGUF's packed block weights (hearth/models/weight_cache.py): processes
    # on this host that load the same file alike map one copy, and a restart skips the repack.
    # "" (default): none, each process packs its own
    weight_cache: str = ""
    # Compute dtype of many-row GEMMs (prefill chunks, large batches) of a float32 model:
    # float32 (exact) | bfloat16 | auto (bfloat16 where the CPU runs AMX tiles, else float32).
    prefill_dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own context length
    # An HF rope_scaling object as JSON text, replacing the checkpoint's (linear | llama3 |
    # yarn; hearth/models/rope_scaling.py); the context grows to what it scales to. None: as
    # the checkpoint says.
    rope_scaling: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None  # override: folder with tokenizer.json
    seed: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0  # memory budget for the KV pool
    num_blocks: int | None = None  # explicit override of the budget (tests)
    enable_prefix_caching: bool = True
    # model (the model dtype: exact) | auto (bfloat16 for a float32 model on hearth's CPU
    # kernels, else the model dtype; the CLI's default) | float32 | bfloat16 | float16 | int8 |
    # fp8 (int8 or fp8 e4m3 values with a float32 scale per token and head:
    # hearth/ops/kv_quant.py)
    kv_cache_dtype: str = "model"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 64  # cap on running requests
    # While any request decodes, a step's prompt tokens are bounded so its streams' next tokens
    # do not wait behind a long chunk (hearth/engine/step_policy.py): by this count (0: no cap
    # of its own) and by what fits a step of `itl_target_ms` at the measured cost per prompt
    # token (0: off; `hearth serve` sets it).
    max_prompt_tokens_while_decoding: int = 0
    itl_target_ms: float = 0.0
    # A waiting request whose prompt is mostly cached (a session's next turn) is admitted
    # before colder ones ahead of it, each of which it may pass this many times (0: FIFO).
    next_turn_max_bypass: int = 8

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens_while_decoding", "itl_target_ms", "next_turn_max_bypass"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: off), got {getattr(self, name)}")
    # (the bound on queued requests is the server's: ServerConfig.max_waiting)


@dataclass(frozen=True)
class GuidedConfig:
    """Limits on structured output (json_schema, tool grammars, regex), checked before a compile.

    Compiles run on `num_compile_threads` threads off the engine loop. String lengths and regex
    repetition counts unroll into automaton states (compile time grows faster than linearly:
    1024 takes about 0.5 s, 4096 about 11 s), so they have a tighter bound than item counts.
    """

    max_spec_bytes: int = 131072  # JSON text of a schema or tool set, or a regex / grammar
    max_schema_depth: int = 64  # nesting of the schema document (objects and arrays)
    max_length_bound: int = 1024  # each minLength / maxLength and regex {m,n} count
    max_total_length_bound: int = 8192  # their sum over one spec
    max_count_bound: int = 4096  # each min/maxItems, min/maxProperties, min/maxContains
    compile_timeout_s: float = 20.0  # a request whose grammar takes longer fails (400)
    num_compile_threads: int = 2
    max_compiles_in_flight: int = 8  # queued + running (timed-out ones count until done)
    cache_size: int = 256  # compiled grammars kept, least recently used evicted
    # forced tokens (tool-call wrappers, keys) are appended without a decode step each; off:
    # the mask forces the same tokens one step each (same output, the parity reference)
    jump_forward: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_micro_batches: int = 0  # 0: one per pipeline stage
    # A MoE model's experts split whole across the tensor-parallel ranks (EP size = TP size)
    # instead of each expert cut along its width; attention stays tensor-parallel.
    enable_expert_parallel: bool = False
    device: str = "cpu"  # cpu | cuda
    # Rendezvous of an externally launched rank set (torchrun env); None: spawn ranks locally.
    master_addr: str | None = None
    master_port: int = 0
    agent_store: bool = False  # the launcher's agent hosts the store (torchrun elastic)
    collective_timeout_s: float = 60.0  # a rank waiting longer on a peer fails the step

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation of one worker (read by `hearth.kv_transfer`, not the engine)."""

    role: Role = Role.BOTH  # both (monolithic) | prefill (exports KV) | decode (imports KV)
    transport: str = "tcp"  # tcp (hearth's own) | mooncake (Mooncake Transfer Engine)
    host: str = "127.0.0.1"  # interface the transfer server binds (prefill side)
    port: int = 0  # transfer server port; 0 picks a free one
    advertise_host: str | None = None  # address written into descriptors; None: `host`
    secret: str = ""  # shared secret both sides prove in the transfer handshake (HMAC)
    # KV servers a decode worker may connect to: "host:port" or "host" (any port); empty:
    # loopback only. Descriptors naming any other peer are not contacted (recompute instead).
    peers: tuple[str, ...] = ()
    # ... plus the entries of this file, re-read when it changes (hearth/kv_transfer/peers.py)
    peers_file: str | None = None
    lease_seconds: float = 30.0  # how long exported blocks wait for the decode side
    # Leased blocks past this fraction of the pool end the oldest leases first, so exports
    # whose decode hop never comes cannot starve new prefills.
    max_leased_fraction: float = 0.5
    io_timeout_seconds: float = 30.0  # a socket stalled this long is dropped
    handshake_timeout_seconds: float = 2.0  # a connection must authenticate within this
    num_transfer_threads: int = 4  # concurrent imports on the decode side

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role, "kv role"))


@dataclass(frozen=True)
class KVOffloadConfig:
    """KV tiers below the pool (read by `hearth.kv_tiers.store`; docs/kv_tiers.md).

    A cached block evicted from the pool is written, off the step, to the first tier; a prefix
    that continues past the pool's hits into a tier is loaded back instead of recomputed."""

    directory: str | None = None  # disk tier root; None (and host_gb 0): no tiers
    max_gb: float = 8.0  # size cap of the directory tier (least recently used files go first)
    # several workers use `directory` (the tier is named "shared"); its blocks are written as
    # they are computed (write-through), so the others find them before this pool evicts them
    shared: bool = False
    host_gb: float = 0.0  # host-memory tier above the disk (for a pool on a GPU)
    # Mooncake Store instead of a directory: its master ("host:port"), its metadata service URL
    # and the memory segment this worker contributes (hearth/kv_tiers/mooncake_store.py)
    mooncake_master: str | None = None
    mooncake_metadata: str = ""
    mooncake_segment_gb: float = 1.0
    max_pending_blocks: int = 128  # staging buffers of blocks waiting to be written
    load_timeout_seconds: float = 5.0  # a load still running then ends; the rest is recomputed
    num_load_threads: int = 2
    # blocks of waiting requests read ahead into host memory (a record's bytes each), so their
    # admission copies them in instead of waiting for a load; 0: no prefetch
    max_prefetch_blocks: int = 256

    @property
    def enabled(self) -> bool:
        return self.directory is not None or self.host_gb > 0 or self.mooncake_master is not None

    @property
    def write_through(self) -> bool:
        """A tier other workers read is written as blocks are computed, not only at eviction."""
        return self.shared or self.mooncake_master is not None


SPECULATIVE_METHODS = ("off", "ngram", "suffix", "draft", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (hearth/engine/speculative; docs/speculative.md): drafts proposed from the
    request's own context are verified in the same step as everything else."""

    # off | ngram (prompt lookup) | suffix (request + recent outputs) | draft (a small model) |
    # eagle3 (a draft head over the target's hidden states)
    method: str = "off"
    num_speculative_tokens: int = 8  # the most draft tokens per request per step
    max_batch: int = 8  # no drafts when more requests than this are decoding (compute-bound)
    ngram_min: int = 2  # ngram: shortest suffix of the context that must match
    ngram_max: int = 5  # ngram: longest suffix tried first
    suffix_global_tokens: int = 1 << 18  # suffix: recent outputs kept across requests
    min_confidence: float = 0.3  # suffix: stop a draft where its empirical probability drops
    # draft: a model of the same vocabulary (path or name); eagle3: the head's folder
    draft_model: str | None = None
    draft_num_blocks: int = 1024  # draft: its own KV pool, in blocks of the engine's size

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: unsupported {self.method!r}; choose from "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens: must be in [1, 32]")
        if self.method in ("draft", "eagle3") and not self.draft_model:
            raise ValueError(f"speculative_draft_model: required with speculative_method "
                             f"{self.method} (speculative_config: model)")
        if not 1 <= self.ngram_min <= self.ngram_max <= 32:
            raise ValueError("ngram sizes: need 1 <= ngram_min <= ngram_max <= 32")


@dataclass(frozen=True)
class EngineConfig:
    """The composition the engine is built from (each part goes to its own component)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    guided: GuidedConfig = field(default_factory=GuidedConfig)
    kv_offload: KVOffloadConfig = field(default_factory=KVOffloadConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

"""The HTTP server's own configuration (the engine's is hearth.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.api.edge import DoorwayConfig


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # names `model` may give; the first is the one responses carry. (): the engine's model name
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None  # when set, every /v1 and admin route needs "Authorization: Bearer KEY"
    max_waiting: int = 256  # requests queued beyond the engine's running set; past it: 429
    max_body_bytes: int = 32 * 2**20  # request bodies larger than this: 413
    tool_call_parser: str = "auto"  # auto (by model family) | one of tool_parsers.TOOL_PARSERS
    # <think> blocks -> reasoning (reasoning_parsers.REASONING_PARSERS); None: all output is content
    reasoning_parser: str | None = None
    # how chat prompts are written: auto (harmony where the model's template writes harmony
    # channels, else the template) | template | harmony (hearth/api/harmony_prompt.py)
    chat_format: str = "auto"
    guided_auto_tools: bool = True  # constrain tool-call arguments also under tool_choice "auto"
    cpu_threads: int = 2  # threads for rendering/tokenizing off the event loop (edge.CpuPool)
    log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any); (): off
    access_log: bool = True  # one line per request on the hearth.access logger
    exit_on_engine_failure: bool = True  # a worker whose engine died stops (exit code 1)
    # header/body/keep-alive timeouts and connections per client address (hearth/api/edge.py)
    doorway: DoorwayConfig = field(default_factory=DoorwayConfig)

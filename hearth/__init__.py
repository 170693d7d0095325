"""hearth: LLM serving for AI agents.

Offline use: `from hearth import LLM, SamplingParams`.
"""

from hearth.engine.sampling_params import SamplingParams


def __getattr__(name):
    # Imported lazily so `import hearth` (the router, the CLI) does not pull in torch.
    if name == "LLM":
        from hearth.engine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]

"""hearth: LLM serving for AI agents.

Offline use: `from hearth import LLM, SamplingParams`. On a Ray cluster: `hearth.deploy(...)`.
"""

from hearth.engine.sampling_params import SamplingParams


def __getattr__(name):
    # Imported lazily so `import hearth` (the router, the CLI) does not pull in torch.
    if name == "LLM":
        from hearth.engine.llm import LLM
        return LLM
    raise AttributeError(name)


def deploy(*args, **kwargs):
    """A deployment on a running Ray cluster, its router served from this process:
    `hearth.deploy(model=..., prefill=, decode=, address="auto", ...)` -> a running `Deployment`
    (hearth/cluster/deployment.py has the arguments). Ray loads only now. The workers' `hearth
    serve` flags come from hearth/flags/ (which hearth/cluster/ sits below), handed down here."""
    from hearth.cluster.deployment import deploy as deploy_on_ray
    from hearth.flags import serve_argv

    return deploy_on_ray(*args, serve_argv=serve_argv, **kwargs)


__all__ = ["LLM", "SamplingParams", "deploy"]

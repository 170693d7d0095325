"""hearth on a Ray cluster (issue 32): `hearth up --cluster` and `hearth scale`.

Ray is an optional extra (`pip install 'hearth[ray]'`); nothing outside this package imports it,
so `hearth up` without `--cluster` never loads Ray. The pieces:

  * `cluster_config.py` — ClusterConfig: where the cluster is, what each rank asks of Ray;
  * `registry.py` — the named `WorkerRegistry` actor (workers, targets, the router's
    acknowledgements, the secrets) and `RayRegistry`, the router's view of it;
  * `worker_actor.py` — `WorkerProcess`, the actor that runs one `hearth serve` on its node;
  * `controller.py` — `Controller`: places workers (one placement group each), replaces the
    dead, scales to the registry's targets, drains before it stops a worker;
  * `autoscaler.py` — `Autoscaler`: a role's target from the router's open requests;
  * `peer_refresh.py` — decode workers replaced when a prefill worker serves on a node that
    joined after them (their KV allow-list is fixed at start);
  * `deploy.py` — `up_cluster` (what `hearth up --cluster` runs) and `scale`;
  * `deployment.py` — the Python API: `hearth.cluster.deploy(...)` -> `Deployment` (the same
    controller and router as `hearth up --cluster`, the router in a thread of the caller).
See docs/deploy.md.
"""


def __getattr__(name):
    # `hearth.cluster.deploy(...)` without importing anything heavy (or Ray) before it is called:
    # the module hearth/cluster/deploy.py is callable (it forwards to deployment.deploy).
    if name == "deploy":
        import importlib

        return importlib.import_module("hearth.cluster.deploy")
    raise AttributeError(name)

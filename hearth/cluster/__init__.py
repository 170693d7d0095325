"""hearth on a Ray cluster (issue 32): `hearth up --cluster` and `hearth scale`.

Ray is an optional extra (`pip install 'hearth[ray]'`); nothing outside this package imports it,
so `hearth up` without `--cluster` never loads Ray. The pieces:

  * `cluster_config.py` — ClusterConfig: where the cluster is, what each rank asks of Ray;
  * `worker_registry.py` — the named `WorkerRegistry` actor (workers, targets, the router's
    acknowledgements, the secrets) and `RayRegistry`, the router's view of it;
  * `worker_actor.py` — `WorkerProcess`, the actor that runs one `hearth serve` on its node;
  * `controller.py` — `Controller`: places workers (one placement group each), replaces the
    dead, scales to the registry's targets, drains before it stops a worker;
  * `autoscaler.py` — `Autoscaler`: a role's target from the router's open requests;
  * `commands.py` — `up_cluster` (what `hearth up --cluster` runs) and `scale`;
  * `deployment.py` — the Python API behind `hearth.deploy(...)` -> `Deployment` (the same
    controller and router as `hearth up --cluster`, the router in a thread of the caller).
Nothing here imports hearth/flags/ (the flags build this package's ClusterConfig): a worker's
`hearth serve` flags come from the `serve_argv` its caller hands down. See docs/deploy.md.
"""

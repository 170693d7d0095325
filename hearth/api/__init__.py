"""The HTTP protocol the router shares with the workers: request/response models and errors
(protocol, errors, the Responses and Messages APIs and their writers, chat chunks and events),
the doorway (edge: body limits, API keys, the CPU pool; middleware), the PD hop fields
(pd_protocol), the load report and the readiness probe. Both `hearth.server` (a worker) and
`hearth.router` import it; it imports neither."""

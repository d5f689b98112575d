"""The activator (`kiln activator`): holds requests for a model scaled to zero while its
first replica starts.

At zero replicas the operator points the model's Service at the activator pods (an
EndpointSlice it writes, `kiln.operator.activation`); a request that arrives here is held
in the model's bounded queue for a bounded wait, the model is scaled to one at once (a
conditional patch of its scale subresource, so several activator replicas do it once),
and the held requests are forwarded, each exactly once, when a runtime pod is Ready. Once
a pod is Ready the operator gives the Service back to the runtime pods: the activator is
on the path only at zero. Stateless: what it knows (which pods are Ready) comes from a
watch, so any number of replicas may run.

    table.py     which runtime pods are Ready, per model (filled by the watch; pure)
    holding.py   the per-model bounded queue and wait, and activation once per episode
    routing.py   which model a request is for (its path or message, and its Host)
    rest.py      the v2 REST paths (aiohttp), forwarded once (a refused connect may try again)
    grpcproxy.py the v2 gRPC service (grpc.aio), reusing the runtime's generated messages
    cluster.py   the Kubernetes side: the pod watch and the scale-from-zero patch
    command.py   `kiln activator`
"""

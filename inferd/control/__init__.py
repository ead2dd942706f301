"""The control plane, in the server process: the controller's reconcile loop over the
registry, the orchestrators behind one Protocol (local processes, in-process cores,
Kubernetes), replica supervisors, joined replicas, rollout policies and canary analysis,
autoscaling and on-demand loading, the routing table's publisher and the gateways it
feeds, leadership, GPU placement and the console's figures.
"""

"""The framework-free engine that runs one process's pipeline stages: ``engine`` (forward/backward of a batch,
evaluation, the loss over stages and replicas), ``stages`` (a stage's blocks and torch's ``PipelineStage`` per batch
shape), ``wavefront`` (the time-chunked schedule), ``gradients`` (sums over replicas, the global-norm clip),
``replica_sums`` (the sums over replicas posted during the backward pass), ``norm_exchange`` (the clip's norm over the
pipeline through receives posted ahead), ``groups`` (a process's groups in the mesh) and ``tied`` (weights shared
between stages).

Imports neither Lightning nor the strategy: the strategy owns the engine and calls it.
"""

"""Leaving one machine: placement that is pure computation, the pools' records, the Slurm script, ``asyncrl launch``.

Nothing here imports Ray (the Ray engine is :mod:`asyncrl.integrations.ray`, imported only by ``asyncrl launch
--engine ray``):

- :mod:`~.placement`: the trainer gang's bundles, ranks from placed bundles (sorted by node IP), torchrun's variables
  per rank, the fleet's target per node, each worker's weight path by locality;
- :mod:`~.registry`: a pool's record (endpoint, CURVE public key, weight channel) written by each trainer rank and
  read by workers (a file on shared storage, or the Ray registry actor's copy); the allow-list file a pool watches;
- :mod:`~.slurm`: the ``sbatch`` script of ``--engine slurm``;
- :mod:`~.launch`: ``asyncrl launch``.
"""

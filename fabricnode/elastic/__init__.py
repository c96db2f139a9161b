"""The elastic fabric: declared models kept served through Slurm jobs and scaled with demand.

* ``servicefile`` the service file (TOML): its format, the pure parser/validator, canonical
  bytes, the renderer back to TOML.
* ``plans``       the service file as the controller's plans (``"auto"`` GPUs from the planner).
* ``slurmctl``    submit, list and cancel the controller's Slurm jobs (tagged), or dry-run them.
* ``jobs``        ``Job``: one of the controller's Slurm jobs as squeue shows it (pure).
* ``reconcile``   one controller pass: from Slurm's and the mesh's view, the jobs to submit and
  cancel (keep-alive across time limits, replacement, scaling, back-off, limits).
* ``leader``      which of the ``--controller`` agents acts.
* ``controller``  the control loop (read, decide, act) and its status and decisions.
* ``policy``      the pure scaling policy: per model, how many replicas to run now (a token-demand
  forecast at the cold-start horizon, load and TTFT confirmation, scale-in hysteresis), and the
  static and reactive baselines with the same interface.
* ``demand``      the demand rules: scale from zero on requests held, idle to zero.
* ``signals``     what the policy is told: the agents' request logs (polled incrementally), the
  replicas' gossiped load, the p95 TTFT.
* ``capacity``    what one replica sustains, from the planner or a low default.
* ``follow``      the controller's scaler: the demand rules, and the policy above them.
"""

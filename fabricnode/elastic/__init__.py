"""The elastic fabric: models kept served through Slurm and scaled with demand.

* ``slurmctl``  submit, list and cancel the controller's Slurm jobs (tagged), or dry-run them.
* ``reconcile`` one controller pass: from Slurm's and the mesh's view, the jobs to submit and
  cancel (keep-alive across time limits, replacement, scaling, back-off, limits).
"""

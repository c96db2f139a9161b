"""The elastic controller: keeps declared models served through Slurm and follows demand.

Modules:

* ``policy``  the pure scaling policy: per model, how many replicas to run now (a token-demand
              forecast at the cold-start horizon, load and TTFT confirmation, scale-in
              hysteresis), and the static and reactive baselines with the same interface.
"""

"""The elastic fabric: declared models kept served through Slurm jobs and scaled with demand.

From the top (the ``elastic-layers`` contract in pyproject.toml: a module imports only those
below it, and nothing imports the loop):

* ``controller``  the control loop (read, decide, act) on trio, and its status and decisions.
* ``follow``      the controller's scaler: the demand rules, and the policy above them.
* ``demand``      the demand rules: scale from zero on requests held, idle to zero (``activity``).
* ``observe``     every look outside and every blocking call: the agents' request logs through
  one client, the registry's replicas, load and wanted models, Slurm in worker threads.
* ``reconcile``   one controller pass, pure: from Slurm's and the mesh's view, the jobs to submit
  and cancel (keep-alive across time limits, replacement, scaling, back-off, limits).
* ``plans``       the service file as the controller's plans (``"auto"`` GPUs from the planner).
* ``sitespread``  capacity across sites: our site's share of a model counted over several sites
  (``prefer_sites``), from what the other sites serve (pure).
* ``slurmctl``    the Slurm command lines: submit, list and cancel the controller's (tagged) jobs,
  or dry-run them.
* ``capacity``    what one replica sustains, from the planner or a low default.
* ``throughput``  what one replica sustains, learned from replicas seen saturated (the gossiped
  load and the request logs, fed by ``follow``), over the prior ``capacity`` gives (pure).
* ``jobs``        ``Job``: one of the controller's Slurm jobs as squeue shows it (pure).
* ``vocab``       the words the others share: a model's plan, goals, actions, decisions and
  their reasons (``Reason``: the metric's labels), the fleet, the scaler protocol.
* ``servicefile`` the service file (TOML): ``parse``, ``load``, ``from_canonical``, the engine
  template a model's jobs render; the names below re-exported. In its parts:
* ``servicecheck``  a parsed document into a spec, or every problem at its line.
* ``servicevalues`` one check per kind of value (reaches ``host.slurm`` and ``engine.template``
  for the time-limit and template parsers: not in ``elastic-pure``).
* ``servicespec``   the spec, the format's keys and bounds, canonical bytes, JSON and TOML (pure).
* ``tomllines``     the line of every key of a TOML document, for the problems (pure).
* ``policy``      the pure scaling policy: per model, how many replicas to run now (a token-demand
  forecast at the cold-start horizon, load and TTFT confirmation, scale-in hysteresis), and the
  static and reactive baselines with the same interface.
* ``need``        scale by need: the replicas a model's work needs when a replica submitted now
  arrives (the forecast's rate then, and the queue still left), in one step (pure).
* ``leader``      which of the ``--controller`` agents acts.
* ``startups``    the learned start-up times on the acting controller's entry, and those the
  next one to act takes over (pure).
* ``activity``    when each model was last in demand, from every evidence (wanted, in flight,
  logged, a job started for it), for the idle rule; rebuilt after a takeover (pure).
"""

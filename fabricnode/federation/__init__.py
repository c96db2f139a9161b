"""Federation: one fabric across sites, through gateways (``docs/federation.md``).

Sites exchange signed **summaries** (what each serves and how much more it can take), never
registry entries; gateways of different sites authenticate each other with TLS 1.3 and pinned
site certificates; a silent site is a partition (not routable), never dead.

Modules, from the bottom:

* ``sitekey``  site keys (Ed25519) and their certificates, loaded; the pinned peer sites.
* ``keygen``   making a site key and its self-signed certificate (``fabric keys site-new``).
* ``summary``  the signed site summary, its strict decoder, and the summary of our own site
  read from the registry (pure).
* ``view``     the latest summary and RTT per peer site; routable or not (pure, time passed in).
* ``protocol`` the link's framing and messages (pure).
* ``settings`` ``FederationConfig``: the gateway's flags as ``fabricnode.config`` checks them.
* ``link``     the trio shell: the federation port (mutual TLS), dialing the peers, sending our
  summary, feeding theirs into the view; ``Gateway`` is what the agent starts.
* ``metrics``  the ``fabric_federation_*`` families on the agent's ``/metrics`` page.

Imports the mesh (the registry a summary is built from) and the shared modules; the agent
starts the link, the admin API reads the view (``GET /fabric/v1/sites``). Start reading at
``view``.
"""

"""``fabric keys ...``: cluster keyrings, provider, operator and site keys, ingress API keys.

Every command takes its file as an argument or option and defaults to the path under
``$FABRIC_HOME`` that ``fabricnode.config`` names, so ``fabric start`` finds what these create.
API-key tokens are printed once and never stored: the file keeps only their hash.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import JsonOption, command_group, console, handled, print_json, usage_error
from fabricnode.config import (
    default_api_keys_path,
    default_cluster_key_path,
    default_operator_key_path,
    default_provider_key_path,
)
from fabricnode.errors import ConfigError, KeyFileError
from fabricnode.mesh.identity import OperatorKey, ProviderKey
from fabricnode.mesh.keyring import KEY_ID_BYTES, Keyring, new_cluster_key

keys_app = command_group(
    "Cluster keys (create, rotate), provider, operator and site keys, and ingress API keys."
)


ClusterKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--cluster-key",
        metavar="PATH",
        help="Keyring file (default $FABRIC_CLUSTER_KEY, else $FABRIC_HOME/cluster.key).",
        show_default=False,
    ),
]


def _key_path(path: Path | None) -> Path:
    return path if path is not None else default_cluster_key_path(os.environ)


def _ring_doc(path: Path, ring: Keyring) -> dict[str, Any]:
    """``--json`` of the keys commands: where the ring is, its primary key id and all ids."""
    return {"path": str(path), "primary": ring.primary.hex(), "keys": ring.key_ids()}


def _key_id(text: str) -> bytes:
    try:
        kid = bytes.fromhex(text)
    except ValueError:
        kid = b""
    if len(kid) != KEY_ID_BYTES:
        raise typer.BadParameter(
            f"{text!r} is not a key id ({2 * KEY_ID_BYTES} hex digits, see `fabric keys list`)"
        )
    return kid


@keys_app.command("new-cluster", help="Create a cluster keyring holding one new key.")
@handled
def keys_new_cluster(
    path: Annotated[
        Path | None,
        typer.Argument(help="Where (default $FABRIC_CLUSTER_KEY, else $FABRIC_HOME/cluster.key)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    target = _key_path(path)
    if target.exists() and not force:
        raise KeyFileError(
            f"{target} already exists (agents using it would lose the mesh); "
            "pass --force to overwrite it, or rotate with `fabric keys add`"
        )
    ring = Keyring.with_key(new_cluster_key())
    ring.save(target)
    if as_json:
        print_json(_ring_doc(target, ring))
        return
    print(f"created cluster keyring {target} with key {ring.primary.hex()}")


@keys_app.command("add", help="Add a new key to the keyring (not primary); prints its id.")
@handled
def keys_add(cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    kid = ring.add(new_cluster_key())
    ring.save(path)
    if as_json:
        print_json({**_ring_doc(path, ring), "added": kid.hex()})
        return
    print(kid.hex())


@keys_app.command("use", help="Make KEYID the primary key (agents seal with it).")
@handled
def keys_use(keyid: str, cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    kid = _key_id(keyid)
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    ring.use(kid)
    ring.save(path)
    if as_json:
        print_json(_ring_doc(path, ring))
        return
    print(f"primary key is now {kid.hex()}")


@keys_app.command("remove", help="Remove KEYID (not the primary) from the keyring.")
@handled
def keys_remove(
    keyid: str, cluster_key: ClusterKeyOption = None, as_json: JsonOption = False
) -> None:
    kid = _key_id(keyid)
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    ring.remove(kid)
    ring.save(path)
    if as_json:
        print_json({**_ring_doc(path, ring), "removed": kid.hex()})
        return
    print(f"removed key {kid.hex()}")


@keys_app.command("list", help="Key ids in the keyring; the primary one is marked.")
@handled
def keys_list(cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    primary = ring.primary.hex()
    if as_json:
        print_json(_ring_doc(path, ring))
        return
    for kid in ring.key_ids():
        print(f"{kid} primary" if kid == primary else kid)


@keys_app.command("new-provider", help="Create a long-lived provider key; prints its fingerprint.")
@handled
def keys_new_provider(
    path: Annotated[
        Path | None, typer.Argument(help="Where (default $FABRIC_HOME/provider.key).")
    ] = None,
    provider: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="Provider name (default $USER).", show_default=False),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    name = provider or os.environ.get("USER", "")
    if not name:
        usage_error("keys new-provider", "no provider name: pass --provider NAME")
    target = path if path is not None else default_provider_key_path(os.environ)
    if target.exists() and not force:
        raise KeyFileError(f"{target} already exists; pass --force to overwrite it")
    key = ProviderKey.generate(name)
    key.save(target)
    if as_json:
        print_json({"path": str(target), "provider": name, "fingerprint": key.fingerprint})
        return
    print(f"created provider key {target} for {name!r}, fingerprint {key.fingerprint}")


@keys_app.command(
    "new-operator",
    help="Create an operator key (signs `fabric plan --apply`); prints the fingerprint agents "
    "must trust (--trust-operator / FABRIC_TRUST_OPERATORS).",
)
@handled
def keys_new_operator(
    path: Annotated[
        Path | None, typer.Argument(help="Where (default $FABRIC_HOME/operator.key).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    target = path if path is not None else default_operator_key_path(os.environ)
    if target.exists() and not force:
        raise KeyFileError(f"{target} already exists; pass --force to overwrite it")
    key = OperatorKey.generate()
    key.save(target)
    if as_json:
        print_json({"path": str(target), "fingerprint": key.fingerprint})
        return
    print(f"created operator key {target}, fingerprint {key.fingerprint}")
    print(f"agents act on its plans when started with --trust-operator {key.fingerprint}")


@keys_app.command(
    "site-new",
    help="Create a site key for a gateway (--gateway): DIR/site.key (private, 0600) and "
    "DIR/site.pem, its certificate, which the operators of peer sites copy into their "
    "--peer-sites directory. Prints the fingerprint they compare.",
)
@handled
def keys_site_new(
    site: Annotated[str, typer.Option(metavar="NAME", help="The site's name.")],
    out: Annotated[Path, typer.Option(metavar="DIR", help="Where to write the two files.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing key.")] = False,
    as_json: JsonOption = False,
) -> None:
    from fabricnode.federation.keygen import generate_site_key
    from fabricnode.federation.sitekey import KEY_FILE, check_site_name

    try:
        check_site_name(site, "--site")
    except ConfigError as exc:
        usage_error("keys site-new", str(exc))
    if (out / KEY_FILE).exists() and not force:
        raise KeyFileError(
            f"{out / KEY_FILE} already exists (peer sites pin its certificate); "
            "pass --force to replace it"
        )
    key = generate_site_key(site, out)
    if as_json:
        print_json(
            {
                "site": key.site,
                "fingerprint": key.fingerprint,
                "key": str(key.key_path),
                "certificate": str(key.cert_path),
            }
        )
        return
    print(f"created site key {key.key_path} for site {site!r}, fingerprint {key.fingerprint}")
    print(f"peer sites federate with {site!r} by copying {key.cert_path} into their --peer-sites")


@keys_app.command(
    "site-show", help="The site and fingerprint of a site certificate (or of a site key's)."
)
@handled
def keys_site_show(
    path: Annotated[Path, typer.Argument(help="A site certificate (.pem) or site key (.key).")],
    as_json: JsonOption = False,
) -> None:
    from fabricnode.federation.sitekey import SiteCert, SiteKey

    cert = SiteKey.load(path).cert if path.suffix == ".key" else SiteCert.load(path)
    if as_json:
        print_json({"site": cert.site, "fingerprint": cert.fingerprint, "path": str(path)})
        return
    print(f"site {cert.site} fingerprint {cert.fingerprint}")


ApiKeysFileOption = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        metavar="PATH",
        help="API keys file (default $FABRIC_HOME/api-keys.json).",
        show_default=False,
    ),
]


def _api_keys_path(path: Path | None) -> Path:
    return path if path is not None else default_api_keys_path(os.environ)


@keys_app.command(
    "api-new",
    help="Create an ingress API key for NAME. The token goes to stdout, once: it is not stored "
    "(the file keeps only its hash). Creating the first key turns auth on.",
)
@handled
def keys_api_new(
    name: str,
    providers: Annotated[
        str | None,
        typer.Option(metavar="P1,P2", help="Only these providers (names or fingerprints) serve."),
    ] = None,
    rate: Annotated[
        float | None, typer.Option(metavar="R", help="Rate limit, requests per second.")
    ] = None,
    burst: Annotated[
        int | None, typer.Option(metavar="B", help="Burst size (default: one second's worth).")
    ] = None,
    admin: Annotated[
        bool,
        typer.Option(
            "--admin",
            help="May also read the registry (fabric nodes, models, self) and /metrics, which "
            "need such a key once keys are on.",
        ),
    ] = False,
    weight: Annotated[
        float,
        typer.Option(
            metavar="W",
            help="Share of the batch tier (X-Fabric-Priority: batch) against other keys' "
            "waiting batch requests: weight 2 is served twice as often as 1 (1).",
        ),
    ] = 1.0,
    sites: Annotated[
        str | None,
        typer.Option(
            metavar="A,B",
            help="Data residency: only nodes of these sites serve its requests (default: any).",
        ),
    ] = None,
    keys_file: ApiKeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    from fabricnode.dataplane.apikeys import ApiKeyStore, RateLimit, check_key_name, check_weight
    from fabricnode.dataplane.residency import check_sites

    allow: list[str] | None = None
    limited: list[str] | None = None
    try:
        check_key_name(name)
        if providers is not None:
            allow = [p.strip() for p in providers.split(",")]
            if not all(allow):
                raise ConfigError(f"--providers {providers!r}: expected NAME[,NAME...]")
        if sites is not None:
            limited = [s.strip() for s in sites.split(",")]
            try:
                check_sites(limited, f"--sites {sites!r}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if rate is not None:
            RateLimit.of(rate, burst)
        elif burst is not None:
            raise ConfigError("--burst needs --rate")
        check_weight(weight)
    except ConfigError as exc:
        usage_error("keys api-new", str(exc))
    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    try:
        token, key = store.new_key(
            name, allow, rate, burst, admin=admin, weight=weight, sites=limited
        )
    except ConfigError as exc:
        usage_error("keys api-new", str(exc))
    if as_json:
        print_json({"path": str(path), "token": token, **key.public()})
        return
    print(token)
    print(
        f"created API key {key.key_id} for {name!r} in {path}; the token above is shown only "
        "this once and cannot be recovered: store it now",
        file=sys.stderr,
    )


@keys_app.command("api-list", help="Ingress API keys (never their secrets or hashes).")
@handled
def keys_api_list(
    keys_file: ApiKeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    import time as _time

    from fabricnode.dataplane.apikeys import ApiKeyStore

    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    found = store.list()
    if as_json:
        print_json(
            {"path": str(path), "enabled": store.enabled, "keys": [k.public() for k in found]}
        )
        return
    if not store.enabled:
        print(f"no API keys file at {path}: the ingress runs open (no auth)")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in (
        *("KEY ID", "NAME", "STATUS", "SCOPE", "CREATED"),
        *("PROVIDERS", "SITES", "RATE", "WEIGHT"),
    ):
        table.add_column(column, no_wrap=column not in ("PROVIDERS", "SITES"))
    for k in found:
        table.add_row(
            k.key_id,
            k.name,
            "revoked" if k.disabled else "active",
            "admin" if k.admin else "api",
            _time.strftime("%Y-%m-%d %H:%M UTC", _time.gmtime(k.created_at)),
            ", ".join(k.providers) if k.providers is not None else "any",
            ", ".join(sorted(k.sites)) if k.sites is not None else "any",
            f"{k.rate.rate_per_s:g}/s burst {k.rate.burst}" if k.rate else "-",
            f"{k.weight:g}",
        )
    console().print(table)
    active = sum(1 for k in found if not k.disabled)
    print(f"{active} active key{'s' if active != 1 else ''} of {len(found)}")


@keys_app.command(
    "api-revoke", help="Revoke an ingress API key by key id, or by name if it has one active key."
)
@handled
def keys_api_revoke(
    key_id_or_name: str, keys_file: ApiKeysFileOption = None, as_json: JsonOption = False
) -> None:
    from fabricnode.dataplane.apikeys import ApiKeyStore

    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    if not store.enabled:
        raise KeyFileError(f"no API keys file at {path} (nothing to revoke)")
    key, changed = store.revoke(key_id_or_name)
    if as_json:
        print_json({"path": str(path), "changed": changed, **key.public()})
        return
    if changed:
        print(f"revoked API key {key.key_id} ({key.name}); agents drop it within a second or two")
    else:
        print(f"API key {key.key_id} ({key.name}) was already revoked")

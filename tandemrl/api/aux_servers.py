"""Where the auxiliary inference servers of a run listen (a judge, a teacher); stdlib only.

The contract between launchers and trainer processes: a launcher that starts the auxiliary
servers named in ``allocation_mode`` (every inference component but the generation one, e.g.
``vllm[judge]:d1`` in ``vllm[gen]:d1+vllm[judge]:d1+fsdp[actor]:d1``) exports their addresses in
``TANDEMRL_AUX_SERVER_ADDRS`` as one JSON object, name -> list of ``host:port`` (one entry per
data-parallel replica). Trainer code reads them with :func:`aux_server_addresses`. The servers
require the run's token like the generation servers (``TANDEMRL_SERVER_TOKEN``). A launcher that starts
an OpenEnv environment server (``openenv.app``) exports its base URL in ``TANDEMRL_OPENENV_URL``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

AUX_SERVERS_ENV = "TANDEMRL_AUX_SERVER_ADDRS"
OPENENV_URL_ENV = "TANDEMRL_OPENENV_URL"


def format_aux_addresses(addrs: Mapping[str, Sequence[str]]) -> str:
    """The value of ``TANDEMRL_AUX_SERVER_ADDRS`` for ``{name: [host:port, ...]}``."""
    return json.dumps({name: list(a) for name, a in addrs.items()}, sort_keys=True)


def aux_server_addresses(name: str) -> list[str]:
    """``host:port`` of every replica of the auxiliary server ``name``, from the launcher's environment.

    Raises LookupError (one line naming the server and the ones known) when the launcher started
    no server of that name, e.g. ``allocation_mode`` has no ``vllm[NAME]:...`` component.
    """
    raw = os.environ.get(AUX_SERVERS_ENV, "")
    try:
        table = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise ValueError(f"${AUX_SERVERS_ENV} is not a JSON object: {raw[:80]!r}") from None
    if not isinstance(table, dict):
        raise ValueError(f"${AUX_SERVERS_ENV} is not a JSON object: {raw[:80]!r}")
    addrs = table.get(name)
    if not addrs:
        raise LookupError(
            f"no auxiliary server {name!r} in ${AUX_SERVERS_ENV} (servers: {sorted(table)}); "
            f"add an inference component 'vllm[{name}]:d1' to allocation_mode and start the run through a launcher"
        )
    return [str(a) for a in addrs]

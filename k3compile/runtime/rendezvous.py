"""Where the ranks of a run find each other, and what listens on the network while they decode (docs/architecture.md,
"Sharding and the runtime"; the trust model: README, "Trust").

One key-value store (torch.distributed's TCPStore, which holds only plain bytes: gloo's addresses) is hosted by the
launcher of node 0 on a socket this module binds to the address the user names — 127.0.0.1 for a run on one machine
— and every worker joins it as a client, then opens gloo's connections on the network interface that carries that
address (GLOO_SOCKET_IFNAME): on one machine the loopback interface, so nothing listens beyond 127.0.0.1. Nothing
read from the store or from a peer is ever unpickled (torch's elastic agent does unpickle its rendezvous state,
which is why k3compile does not use it), and the results the ranks exchange at the end are JSON.

A TCPStore client that connects to a listener which never answers waits forever, whatever its timeout; `join`
therefore waits for it in a helper thread and gives up a little after the run's timeout with one line. That thread
is still inside torch's C++ code then, and must never return into an interpreter that is shutting down (CPython
unwinds such a thread through C++ frames, which aborts the process): a caller that gets a RendezvousError with
`stuck_thread` set leaves with os._exit (the CLI does).
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import threading
from dataclasses import dataclass

from k3compile.errors import UserError

LOOPBACK = "127.0.0.1"


class RendezvousError(UserError):
    """The ranks cannot meet: a malformed or unusable address, a port in use, nobody answering. `stuck_thread`: a
    store client is still waiting in a helper thread (the process must end with os._exit, module docstring)."""

    stuck_thread = False


# How long past the run's timeout `join` waits for the store client's own timeout to fire: the client raises at
# `timeout`, and a helper thread joined at exactly `timeout` loses that race now and then.
JOIN_GRACE_S = 5.0


@dataclass(frozen=True)
class Rendezvous:
    """The store's address and this launcher's place: node `node_rank` of `nnodes` (node 0 hosts the store)."""

    host: str = LOOPBACK
    port: int = 0
    nnodes: int = 1
    node_rank: int = 0

    @classmethod
    def parse(cls, text: str | None, nnodes: int = 1, node_rank: int = 0) -> Rendezvous:
        """"HOST:PORT" ("[v6]:PORT" for IPv6); None: this machine alone (127.0.0.1, a free port)."""
        if not 1 <= nnodes <= 4096 or not 0 <= node_rank < nnodes:
            raise RendezvousError(f"--node-rank {node_rank} is not one of the {nnodes} nodes (0..{nnodes - 1})")
        if text is None:
            if nnodes > 1:
                raise RendezvousError("--nnodes > 1 needs --rendezvous HOST:PORT (an address of node 0 that every "
                                      "node reaches)")
            return cls()
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]{1,5})|([A-Za-z0-9.-]+):([0-9]{1,5})", text.strip())
        if not m:
            raise RendezvousError(f"--rendezvous {text!r}: expected HOST:PORT (ASCII), e.g. 10.0.0.1:29400")
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4))
        if not 1 <= port <= 65535:
            raise RendezvousError(f"--rendezvous {text!r}: port {port} is not in 1..65535")
        return cls(host, port, nnodes, node_rank)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _address(host: str) -> tuple[int, str]:
    """(family, numeric address) of a host name or address."""
    try:
        info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise RendezvousError(f"--rendezvous: cannot resolve {host!r} ({e})") from None
    family, _, _, _, addr = info[0]
    return family, addr[0]


@dataclass
class HostedStore:
    """Node 0's store at `rendezvous` (it owns the listening socket's descriptor and closes it with itself)."""

    store: object
    rendezvous: Rendezvous

    def close(self) -> None:
        self.store = None


def host_store(rdzv: Rendezvous, world: int, timeout: float) -> HostedStore:
    """Node 0: the TCPStore, listening on rdzv.host only (the socket bound here, handed to the store), on rdzv.port
    or, for 0, a free one (HostedStore.rendezvous says which)."""
    import torch.distributed as dist

    family, addr = _address(rdzv.host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, rdzv.port))
        sock.listen(max(128, 2 * world))
    except OSError as e:
        sock.close()
        raise RendezvousError(f"cannot listen on {rdzv} ({e.strerror or e}; is the port in use, or the address not "
                              "one of this machine's?)") from None
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(addr, port, world, True, datetime.timedelta(seconds=timeout), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except (RuntimeError, ValueError) as e:
        sock.close()
        raise RendezvousError(f"cannot start the rendezvous store on {rdzv} ({str(e).splitlines()[0][:200]})") \
            from None
    sock.detach()  # the store took the descriptor over
    return HostedStore(store, Rendezvous(addr, port, rdzv.nnodes, rdzv.node_rank))


def join(rdzv: Rendezvous, timeout: float):
    """A client of the store at rdzv, or one RendezvousError when nothing answers as a store there in `timeout` s."""
    import torch.distributed as dist

    _, addr = _address(rdzv.host)
    out: dict = {}

    def connect() -> None:
        try:
            out["store"] = dist.TCPStore(addr, rdzv.port, None, False, datetime.timedelta(seconds=timeout))
        except Exception as e:  # torch's DistStoreError / RuntimeError: reported below as one line
            out["error"] = e

    t = threading.Thread(target=connect, daemon=True, name="k3compile-rendezvous")
    t.start()
    t.join(timeout + JOIN_GRACE_S)
    if "store" in out:
        return out["store"]
    why = (str(out["error"]).strip().splitlines() or ["refused"])[0][:200] if "error" in out else \
        f"nothing answered as a k3compile run's rendezvous within {timeout:g} s"
    err = RendezvousError(f"cannot join the run at {rdzv}: {why} (is node 0's `k3compile run` started there?)")
    err.stuck_thread = t.is_alive()
    raise err


def interface_of(rdzv: Rendezvous) -> str:
    """The name of this machine's network interface that reaches rdzv.host (gloo listens on it only): the one holding
    that address, else the one the kernel routes to it from."""
    import psutil

    family, addr = _address(rdzv.host)
    if ipaddress.ip_address(addr).is_loopback:
        local = addr
    else:
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.connect((addr, rdzv.port or 9))  # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
        except OSError as e:
            raise RendezvousError(f"no route from this machine to {rdzv} ({e.strerror or e})") from None
        finally:
            probe.close()
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return name
    raise RendezvousError(f"no network interface of this machine holds {local} (the address that reaches {rdzv})")

"""Where Server ▸ Start serving listens, and who may use it: ``ServerAddress``, saved in the settings and checked
before the server starts, in the words the Settings dialog and the error notice show.

The server listens on 127.0.0.1 (this machine only) unless the user opts in to other machines (``remote``); then it
listens on ``host`` and every request needs one of ``api_keys``. ``check`` refuses a remote address without a key
here, before the engine's own ``check_bind`` would refuse it with the CLI's words.
"""

from __future__ import annotations

import enum
import errno
import ipaddress
import socket
from dataclasses import dataclass

from app.settings.store import Settings

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerAddress:
    """``host`` is what was typed for other machines (used only when ``remote``); ``listen_host`` is where the
    server binds."""

    port: int = 8000
    remote: bool = False
    host: str = "0.0.0.0"
    api_keys: tuple[str, ...] = ()

    @property
    def listen_host(self) -> str:
        return self.host.strip() if self.remote else LOOPBACK


class PortState(enum.Enum):
    FREE = "free"
    BUSY = "busy"  # another program (or another server) listens there
    DENIED = "denied"  # ports below 1024 need administrator rights
    NO_ADDRESS = "no_address"  # this machine has no such address, or the name does not resolve


def address_from_settings(settings: Settings) -> ServerAddress:
    keys = tuple(str(k) for k in settings.get("server/api_keys") if str(k).strip())
    return ServerAddress(int(settings.get("server/port")), bool(settings.get("server/remote")),
                         str(settings.get("server/host")), keys)


def save_address(settings: Settings, addr: ServerAddress) -> None:
    settings.set("server/port", addr.port)
    settings.set("server/remote", addr.remote)
    settings.set("server/host", addr.host.strip())
    settings.set("server/api_keys", list(addr.api_keys))
    settings.sync()  # a server setting is worth keeping even if the app is killed later


def parse_keys(text: str) -> tuple[str, ...]:
    """API keys typed one per line or separated by commas, each once, in order."""
    parts = (p.strip() for line in text.splitlines() for p in line.split(","))
    return tuple(dict.fromkeys(p for p in parts if p))


def is_loopback_host(host: str) -> bool:
    """127.x, ::1 or localhost: only this machine can connect (names other than localhost are not resolved)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(addr: ServerAddress) -> str:
    """Why ``addr`` cannot be used, in one line; "" when it can."""
    if not 1 <= addr.port <= 65535:
        return f"Port {addr.port} is not a port: choose one from 1 to 65535."
    for key in addr.api_keys:
        if not key.isascii() or not key.isprintable() or " " in key:
            return "An API key may only have printable ASCII characters without spaces (clients send it in a header)."
    if not addr.remote:
        return ""
    if not addr.host.strip():
        return "Type the address other machines connect to (0.0.0.0: every network of this machine)."
    if not addr.api_keys and not is_loopback_host(addr.host):
        return "Other machines may connect only with an API key: type one (or more) under API keys."
    return ""


def port_state(host: str, port: int) -> PortState:
    """Whether the server could listen on ``host``:``port`` now (tries to bind, as the server will)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
    except (OSError, UnicodeError):
        return PortState.NO_ADDRESS
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: a closed port is free
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return PortState.BUSY
            return PortState.DENIED if e.errno == errno.EACCES else PortState.NO_ADDRESS
    return PortState.FREE


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` now (the system's pick)."""
    with socket.socket() as s:
        s.bind((host.strip("[]") if host.strip() not in ("", "0.0.0.0") else "", 0))
        return int(s.getsockname()[1])


def describe_port(state: PortState, host: str, port: int) -> str:
    """The Settings dialog's line under the port."""
    if state is PortState.BUSY:
        return f"Port {port} is in use by another program: pick another (Find a free port)."
    if state is PortState.DENIED:
        return f"Port {port} needs administrator rights: pick one from 1024 up."
    if state is PortState.NO_ADDRESS:
        return f"This machine cannot listen on {host}: check the address."
    return f"Port {port} is free."


def url_for(addr: ServerAddress) -> str:
    host = addr.listen_host
    return f"http://[{host}]:{addr.port}" if ":" in host else f"http://{host}:{addr.port}"

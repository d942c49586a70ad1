"""specdraft audit sandbox: run a module with outgoing sockets blocked and every open recorded.

usage: python sandbox_main.py EVENTS.jsonl -- MODULE ARG...

Run as a program (by path, not ``-m``: importing specdraft would open files before the hook is installed).
One JSON object per line goes to EVENTS.jsonl: {"event": "open", "path", "write", "created", "missing"},
{"event": "connect"|"getaddrinfo"|"sendto"|"bind", ...}, {"event": "spawn", ...}, and first {"event": "start",
"python_roots", "sandbox_dir"}. The sandbox dir is the working directory it was started in: the server's own
place for scratch files. Standard library only.
"""

import ipaddress
import json
import os
import runpy
import site
import socket
import sys
import sysconfig

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile")


class EventLog:
    """Appends each distinct event once to the events file."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.seen: set[str] = set()

    def emit(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True, default=repr)
        if line not in self.seen:
            self.seen.add(line)
            os.write(self.fd, (line + "\n").encode())


def loopback(host) -> bool:
    if host in (None, "", "localhost", "ip6-localhost", "ip6-loopback"):
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def literal(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    try:
        ipaddress.ip_address(str(host).split("%")[0])
        return True
    except ValueError:
        return False


def address(addr):
    if isinstance(addr, tuple) and addr:
        return addr[0], list(addr)
    return None, repr(addr)


def python_roots() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.update(p for p in sysconfig.get_paths().values() if p)
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    return sorted(r for r in roots if r)


def make_hook(events: EventLog):
    emit = events.emit

    def hook(event, hargs):
        if event == "open":
            path, mode, flags = (tuple(hargs) + (None, None, None))[:3]
            if path is None or isinstance(path, int):
                return
            try:
                p = os.path.abspath(os.fsdecode(path))
            except (TypeError, ValueError):
                p = repr(path)
            write = bool(isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                bool(isinstance(flags, int) and flags & WRITE_FLAGS)
            # The hook runs before the open: a file absent now and opened for writing is one the server creates
            # (its own scratch file, not data it found); absent and opened for reading, a probe that reads nothing.
            exists = os.path.exists(p)
            emit({"event": "open", "path": p, "write": write, "created": write and not exists,
                  "missing": not write and not exists})
        elif event == "socket.connect":
            sock, addr = hargs
            host, rendered = address(addr)
            emit({"event": "connect", "family": str(getattr(sock, "family", "")), "address": rendered,
                  "blocked": True})
            raise PermissionError(f"specdraft audit sandbox: outgoing connection to {rendered} blocked")
        elif event in ("socket.sendto", "socket.sendmsg"):
            sock, addr = hargs[0], hargs[1] if len(hargs) > 1 else None
            host, rendered = address(addr)
            if addr is not None and not loopback(host):
                emit({"event": "sendto", "address": rendered, "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: datagram to {rendered} blocked")
        elif event == "socket.getaddrinfo":
            host = hargs[0]
            if not loopback(host) and not literal(host):  # a literal address needs no lookup: connect decides
                emit({"event": "getaddrinfo", "host": repr(host), "port": repr(hargs[1]), "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: name lookup of {host!r} blocked")
        elif event == "socket.gethostbyname" or event == "socket.gethostbyaddr":
            host = hargs[0] if hargs else None
            if not loopback(host):
                emit({"event": event.split(".")[1], "host": repr(host), "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: name lookup of {host!r} blocked")
        elif event == "socket.bind":
            sock, addr = hargs
            host, rendered = address(addr)
            ok = loopback(host) or getattr(sock, "family", None) == getattr(socket, "AF_UNIX", None)
            emit({"event": "bind", "address": rendered, "blocked": not ok})
            if not ok:
                raise PermissionError(f"specdraft audit sandbox: bind to {rendered} blocked (loopback only)")
        elif event in SPAWN_EVENTS:
            emit({"event": "spawn", "via": event, "args": repr(hargs)[:300], "blocked": True})
            raise PermissionError(f"specdraft audit sandbox: {event} blocked")
        elif event == "urllib.Request":
            emit({"event": "urllib", "url": repr(hargs[0])[:300], "blocked": True})
            raise PermissionError("specdraft audit sandbox: urllib request blocked")
    return hook


def main() -> None:
    events_path = sys.argv[1]
    sep = sys.argv.index("--")
    module, args = sys.argv[sep + 1], sys.argv[sep + 2:]
    # Run the module as `python -m` would: its import path starts at the working directory, not at this file's
    # package directory (whose modules would otherwise shadow top-level names).
    sys.path[0] = os.getcwd()
    events = EventLog(events_path)
    events.emit({"event": "start", "pid": os.getpid(), "cwd": os.getcwd(), "python_roots": python_roots(),
                 "sandbox_dir": os.getcwd(), "module": module, "args": args})
    sys.addaudithook(make_hook(events))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

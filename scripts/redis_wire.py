"""The Redis client of the measuring scripts (`budget-script-cost`,
`throttle-script-cost`, `request-path-floor`): RESP over one loopback socket,
nothing else to install. Imported from the scripts' own directory."""

import socket
import sys
import time


def free_port():
    """A free loopback port, for a redis-server started right after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """One connection; waits up to 60 s for the server to accept it. A reply
    that is an error ends the script with it."""

    def __init__(self, port):
        deadline = time.monotonic() + 60
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"redis-server on port {port} did not answer within 60 s")
                time.sleep(0.1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def send(self, *commands):
        """Sends the commands (each a tuple of arguments) in one write."""
        self.sock.sendall(b"".join(self.encode(*c) for c in commands))

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return rest
        if kind == b"-":
            sys.exit("Redis answered an error: " + rest.decode())
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(max(int(rest), 0))]
        sys.exit(f"unexpected reply from Redis: {line!r}")

    def call(self, *args):
        self.send(args)
        return self.read()


def callgrind_total(path):
    """The instructions a callgrind output file counted in all."""
    with open(path) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(("summary:", "totals:")))

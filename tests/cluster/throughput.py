"""One TCP stream between two hosts of a cluster, measured at the receiver (plain Python sockets).

    throughput.py recv PORT TIMEOUT_S          prints "ready", then one JSON line at the end
    throughput.py send ADDRESS PORT SECONDS TIMEOUT_S

Every wait is bounded: the receiver gives up after TIMEOUT_S without a byte, the sender's connect
and each send time out after TIMEOUT_S.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(port: int, timeout: float) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(1)
        listener.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = listener.accept()
    conn.settimeout(timeout)
    buf = bytearray(CHUNK)
    total, first, last = 0, None, None
    timeline, next_mark = [], 0.0
    with conn:
        while True:
            n = conn.recv_into(buf)
            now = time.monotonic()
            if n == 0:
                break
            if first is None:
                first = now
            total += n
            last = now
            if now >= next_mark:
                timeline.append([now, total])
                next_mark = now + 0.05
    timeline.append([last, total])
    seconds = (last - first) if first is not None else 0.0
    print(json.dumps({"bytes": total, "seconds": seconds,
                      "bits_per_s": total * 8 / seconds if seconds > 0 else 0.0, "timeline": timeline}))


def send(address: str, port: int, seconds: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the receiver is listening before we start; retry a refused connect briefly anyway
        try:
            sock = socket.create_connection((address, port), timeout=timeout)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    total = 0
    with sock:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
            total += len(payload)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the receiver's close: everything arrived
    print(json.dumps({"bytes": total}))


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(int(sys.argv[2]), float(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))

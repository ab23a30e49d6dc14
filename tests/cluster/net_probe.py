"""What emulated_hosts_test runs on a host to see the network from there.

  net_probe.py serve PORT                 accept forever; each connection gets "ok", then
                                          everything it sends is counted and the count sent back
  net_probe.py connect ADDR PORT SECONDS  prints "ok", "timeout" or "error <errno name>"
  net_probe.py send ADDR PORT BYTES       sends BYTES, prints the seconds it took to be
                                          acknowledged by the server's count
"""
import errno
import socket
import sys
import threading
import time


def serve(port):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(16)

    def handle(conn):
        with conn:
            conn.sendall(b"ok")
            total = 0
            while True:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                total += len(chunk)
            conn.sendall(str(total).encode())

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def connect(addr, port, seconds):
    s = socket.socket()
    s.settimeout(seconds)
    try:
        s.connect((addr, port))
        print(s.recv(2).decode())
    except socket.timeout:
        print("timeout")
    except OSError as e:
        print("error", errno.errorcode.get(e.errno, e.errno))


def send(addr, port, count):
    s = socket.create_connection((addr, port), timeout=60)
    assert s.recv(2) == b"ok"
    start = time.monotonic()
    s.sendall(b"x" * count)
    s.shutdown(socket.SHUT_WR)
    got = int(s.recv(64).decode())
    assert got == count, (got, count)
    print("%.3f" % (time.monotonic() - start))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve(int(args[0]))
    elif command == "connect":
        connect(args[0], int(args[1]), float(args[2]))
    elif command == "send":
        send(args[0], int(args[1]), int(args[2]))

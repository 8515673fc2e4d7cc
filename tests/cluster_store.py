"""An S3 store on a host of its own in a cluster (tests/cluster): moto's server inside the store
host, listening on its address, so that every byte a loader fetches crosses the store's shaped link.

    store = S3Store(cluster["store"], workdir)      # moto inside the host, a bucket made
    uri = store.upload_folder(folder, "llama")     # from inside the store host, over its loopback
    env = store.env()                             # what a loader on any host sets
    before = store.sent_bytes()                    # bytes out of the store's eth0 (its link)

What the store served is counted at its interface (``sent_bytes``: every byte its eth0 sent, TCP
and IP headers included, about 4.5% over the payload at an MTU of 1500), so a count is what
crossed the store's link, whoever asked. Used by tests/test_cluster_loads.py and
benchmarks/bench_cluster_loads.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

VENV_BIN = os.path.dirname(sys.executable)
ACCESS_KEY = "distload-test"
SECRET_KEY = "cluster-store-secret-key-not-a-real-one"

_WAIT = textwrap.dedent('''
    import socket, sys, time
    port, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > end:
                sys.exit("nothing listens on 127.0.0.1:%d" % port)
            time.sleep(0.1)
''')

_UPLOAD = textwrap.dedent('''
    import os, sys, boto3
    endpoint, bucket, folder, prefix, create = sys.argv[1:6]
    s3 = boto3.session.Session().client("s3", endpoint_url=endpoint)
    if create == "1":
        s3.create_bucket(Bucket=bucket)
    if folder != "-":
        for root, _, names in os.walk(folder):
            for name in sorted(names):
                path = os.path.join(root, name)
                s3.upload_file(path, bucket, prefix + "/" + os.path.relpath(path, folder))
''')


# werkzeug's request line: '"GET /bucket/key HTTP/1.1" 206 -', its method colored on some statuses
_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(?:GET|HEAD|PUT|POST|DELETE) ')


class S3Store:
    """moto's server inside ``host`` on ``0.0.0.0:port``; its bucket ``bucket``."""

    def __init__(self, host, workdir: str, port: int = 9000, bucket: str = "distload-models"):
        self.host, self.port, self.bucket, self.workdir = host, port, bucket, workdir
        exe = shutil.which("moto_server", path=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
        if exe is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        os.makedirs(workdir, exist_ok=True)
        self.log = os.path.join(workdir, "moto.log")
        with open(self.log, "wb") as log:
            self.process = host.run([exe, "-H", "0.0.0.0", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        waited = host.check([sys.executable, "-c", _WAIT, str(port), "30"], timeout=40)
        if waited.returncode != 0:
            raise RuntimeError(f"moto did not start in {host.name}: {waited.stderr} {self._tail()}")
        self._client(["-", "-", "1"])

    def _tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-2000:]

    def _client(self, args: list[str]) -> None:
        env = {**self._keys(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}
        done = self.host.check([sys.executable, "-c", _UPLOAD, f"http://127.0.0.1:{self.port}", self.bucket,
                                args[0], args[1], args[2]], timeout=600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"upload in {self.host.name} failed: {done.stderr[-2000:]}")

    def upload_folder(self, folder: str, prefix: str) -> str:
        """Every file under ``folder`` to ``prefix`` (from inside the store host: its loopback,
        not its link); returns the URI."""
        self._client([folder, prefix, "0"])
        return self.uri(prefix)

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def _keys(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": os.path.join(self.workdir, "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.workdir, "no-aws-credentials")}

    def env(self) -> dict[str, str]:
        """What a loader on any host of the cluster sets to reach this store (over its link)."""
        return {**self._keys(), "AWS_ENDPOINT_URL": f"http://{self.host.address}:{self.port}"}

    def sent_bytes(self) -> int:
        """Bytes the store host's eth0 has sent since it was made: what left the store over its link."""
        out = subprocess.run(["ip", "-n", self.host.netns, "-s", "-j", "link", "show", self.host.ifname],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def requests(self) -> int:
        """The HTTP requests moto has answered so far (werkzeug logs one line for each): zero new
        ones over a step means nothing asked the store, whatever control packets (a late TCP close,
        ARP) its interface counted meanwhile."""
        with open(self.log, errors="replace") as f:
            return sum(1 for line in f if _REQUEST.search(line))

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait(10)

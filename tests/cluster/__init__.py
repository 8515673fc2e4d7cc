"""A cluster of hosts on one machine for tests: see ``netns.py``.

    from cluster import Cluster, require_cluster, cluster_fixture

    cluster = cluster_fixture(hosts=2, rate_bits_per_s=1e9, scope="module")

    def test_something(cluster):
        proc = cluster[0].run(["hostname"], stdout=subprocess.PIPE)
"""

from .netns import (  # noqa: F401
    DEBIAN_SELF_ADDRESS,
    IFNAME,
    PREFIX,
    Cluster,
    Host,
    clean_stale,
    cluster_capability,
    cluster_fixture,
    netns_list,
    require_cluster,
    tbf_burst_bytes,
)

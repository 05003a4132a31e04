"""The real node's cluster DNS (cluster_dns.py): its Corefile, and its version is the one build-node-binaries.sh
builds."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync_tools.localcluster import cluster_dns
from weightsync_tools.localcluster.realnode import NODE_BUILD_SCRIPT, NODE_IP


def test_the_corefile_serves_the_cluster_domain_from_the_api_server_on_the_bridge_alone(tmp_path: Path) -> None:
    text = cluster_dns.corefile(tmp_path / "kubeconfig", NODE_IP)
    assert text.startswith("cluster.local:53 {\n")  # one server block: every other name is refused
    assert text.count("{") == text.count("}") == 2
    assert f"    bind {NODE_IP}\n" in text
    assert f"kubeconfig {tmp_path / 'kubeconfig'}\n" in text and "pods insecure" in text


def test_every_directive_of_the_corefile_is_a_plugin_the_build_compiles_in(tmp_path: Path) -> None:
    built = re.search(r"dnsserver\.Directives = \[\]string\{([^}]*)\}", NODE_BUILD_SCRIPT.read_text())
    assert built is not None
    plugins = set(re.findall(r'"([a-z]+)"', built.group(1)))
    used = {line.split()[0] for line in cluster_dns.corefile(tmp_path / "k", NODE_IP).splitlines()[1:]}
    assert used - {"}", "kubeconfig", "pods"} <= plugins


def test_the_version_is_the_one_the_build_script_builds() -> None:
    default = re.search(r"COREDNS_VERSION=\$\{COREDNS_VERSION:-(v[0-9.]+)\}", NODE_BUILD_SCRIPT.read_text())
    assert default is not None and default.group(1) == cluster_dns.VERSION

"""deploy/kubernetes offline: every resource validates strictly against Kubernetes' own schemas (bundled by
kubernetes-validate) for the oldest and newest versions it has, and the manifests agree with each other and
with kvfs: the ConfigMap is a configuration kvfs accepts, tier paths and the mount's parent match between the
kvfs DaemonSet and the engine, propagation is Bidirectional / HostToContainer, the connector's settings parse,
the metrics port is the scraped one. The image's own kvfs.toml (deploy/container) is checked the same way."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import kvfs
from kvfs.config import build_config

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="tools/install_deploy.sh installs it")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
BUILTIN = ["kvfs.yaml", "vllm-example.yaml"]  # podmonitor.yaml is a Prometheus Operator CRD: no bundled schema
VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def find(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def mounts_by_host_path(pod_spec: dict) -> dict[str, dict]:
    """hostPath → the container's volumeMount of it (one container)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (container,) = pod_spec["containers"]
    return {volumes[m["name"]]["hostPath"]["path"]: m for m in container["volumeMounts"]
            if "hostPath" in volumes[m["name"]]}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", BUILTIN)
def test_manifests_validate_strictly(name, version):
    for doc in load(name):
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError with the path


def test_daemonset_and_engine_agree(tmp_path):
    kvfs_docs, engine_docs = load("kvfs.yaml"), load("vllm-example.yaml")
    ds = find(kvfs_docs, "DaemonSet")["spec"]["template"]
    spec = ds["spec"]
    (daemon,) = spec["containers"]
    assert daemon["securityContext"]["privileged"] is True  # Bidirectional propagation requires it
    assert daemon["image"].endswith(f":{kvfs.__version__}"), daemon["image"]
    env = {e["name"]: e for e in daemon["env"]}
    mountpoint = env["KVFS_MOUNTPOINT"]["value"]
    for secret_var in ("KVFS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env[secret_var]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "kvfs-secrets" and ref["optional"] is True
    probe = daemon["livenessProbe"]["exec"]["command"]
    assert probe == ["kvfs", "stat", mountpoint]

    d_mounts = mounts_by_host_path(spec)
    e_spec = find(engine_docs, "Deployment")["spec"]["template"]["spec"]
    e_mounts = mounts_by_host_path(e_spec)
    parent = d_mounts["/var/lib/kvfs/mnt"]
    assert parent["mountPropagation"] == "Bidirectional"
    assert Path(mountpoint).parent == Path(parent["mountPath"])  # kvfs mounts below the shared directory
    assert e_mounts["/var/lib/kvfs/mnt"]["mountPropagation"] == "HostToContainer"
    assert e_mounts["/var/lib/kvfs/mnt"]["mountPath"] == parent["mountPath"]

    # the ConfigMap is a configuration kvfs accepts, and its tiers lie in the hostPath volumes
    toml = tmp_path / "kvfs.toml"
    toml.write_text(find(kvfs_docs, "ConfigMap")["data"]["kvfs.toml"])
    cfg = build_config(mountpoint, config_file=toml)
    for tier in (cfg.l2, cfg.l3):
        (host_path,) = [h for h, m in d_mounts.items() if tier.path.is_relative_to(m["mountPath"])]
        # the engine binds the same node directory at the same path: kvfs.direct finds the objects there
        assert e_mounts[host_path]["mountPath"] == d_mounts[host_path]["mountPath"], host_path
    assert cfg.state_dir == Path(d_mounts["/var/lib/kvfs/state"]["mountPath"])
    assert "/var/lib/kvfs/state" not in e_mounts
    assert cfg.allow_other
    limit = daemon["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and cfg.max_dirty <= (int(limit[:-2]) << 30) // 2, (cfg.max_dirty, limit)

    # metrics: the configured port is the container's port and the scraped one
    assert cfg.metrics_port == daemon["ports"][0]["containerPort"] and cfg.metrics_address == "0.0.0.0"
    annotations = ds["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port
    monitor = find(load("podmonitor.yaml"), "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= ds["metadata"]["labels"].items()
    assert monitor["podMetricsEndpoints"][0]["port"] == daemon["ports"][0]["name"]

    # the engine: the connector's settings parse, and name the DaemonSet's mountpoint
    from kvfs_connector.settings import Settings

    (vllm,) = e_spec["containers"]
    transfer = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVFSConnector" and transfer["kv_connector_module_path"] == "kvfs_connector"
    assert Settings.from_extra(transfer["kv_connector_extra_config"]).mount == mountpoint
    assert "mountPropagation" not in str(e_spec.get("securityContext", {}))


def test_image_configuration_matches_the_containerfile(tmp_path):
    containerfile = (REPO / "deploy" / "container" / "Containerfile").read_text()
    mountpoint = re.search(r"KVFS_MOUNTPOINT=(\S+)", containerfile).group(1)
    cfg = build_config(mountpoint, config_file=REPO / "deploy" / "container" / "kvfs.toml")
    assert str(cfg.l2.path).startswith("/dev/shm/kvfs/") and str(cfg.l3.path) == "/var/lib/kvfs/l3"
    assert str(cfg.state_dir) == "/var/lib/kvfs/state" and cfg.allow_other
    assert f"EXPOSE {cfg.metrics_port}" in containerfile
    for d in ("/var/lib/kvfs/mnt", "/var/lib/kvfs/state", "/var/lib/kvfs/l3"):
        assert d in containerfile

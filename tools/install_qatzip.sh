#!/usr/bin/env bash
# Fetch Intel QATzip (libqatzip3 with libqat4 and libusdm0) into a project-local prefix.
#
# QATzip is not packaged for Debian 12 or on PyPI; Debian 13 ("trixie") ships it, and its libraries load on
# Debian 12 (they need glibc >= 2.34). This downloads the three .debs from the Debian mirror this machine is
# already configured with (never a hard-coded one), through a private apt state — the system's apt sources,
# lists and packages are not touched — and unpacks them with dpkg -x. kvfs finds the library there
# (kvfs/codecs/qat.py); KVFS_QATZIP_LIB=/path/libqatzip.so.3 overrides.
# On Debian 13 / Ubuntu 24.04 use the system package instead: apt install libqatzip3.
#
# Usage: tools/install_qatzip.sh [PREFIX]      (default: .venv/opt/qatzip)
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${1:-.venv/opt/qatzip}
PACKAGES=(libqatzip3 libqat4 libusdm0)
SUITE=trixie
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
LIB="$PREFIX/usr/lib/x86_64-linux-gnu/libqatzip.so.3"

if [ -e "$LIB" ]; then
    echo "QATzip already in $PREFIX"
    exit 0
fi

# The configured Debian archive (not the security one): deb822 sources first, then the one-line format.
configured_mirror() {
    {
        grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{for (i = 2; i <= NF; i++) print $i}'
        grep -hsE '^deb\s' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
            sed -E 's/\[[^]]*\]//' | awk '{print $2}'
    } | grep -v -e security -e '^$' | grep -E '/debian/?$' | head -n1
}

MIRROR=$(configured_mirror || true)
if [ -z "$MIRROR" ]; then
    echo "install_qatzip: no Debian mirror configured in /etc/apt; on Ubuntu 24.04 or Debian 13 run" \
         "'apt install libqatzip3' instead" >&2
    exit 1
fi
if [ ! -r "$KEYRING" ]; then
    echo "install_qatzip: $KEYRING missing (apt install debian-archive-keyring)" >&2
    exit 1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" > "$WORK/sources.list"
APT=(apt-get -q -o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$WORK/lists" -o Dir::Cache="$WORK/cache" -o APT::Sandbox::User=root)
"${APT[@]}" update >/dev/null
(cd "$WORK" && "${APT[@]}" download "${PACKAGES[@]}" >/dev/null)
mkdir -p "$PREFIX"
for deb in "$WORK"/*.deb; do
    dpkg -x "$deb" "$PREFIX"
done
[ -e "$LIB" ] || { echo "install_qatzip: $LIB missing after unpacking" >&2; exit 1; }
echo "QATzip installed in $PREFIX from $MIRROR ($SUITE): $(cd "$WORK" && ls *.deb | tr '\n' ' ')"

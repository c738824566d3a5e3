# Sourced by the install scripts: apt_install_missing [APT-OPTION…] PKG… installs the Debian packages not yet
# installed (as root, or through sudo), quietly; nothing when all are there. Options go to apt-get install.
apt_install_missing() {
    local options=() missing=() p
    for p in "$@"; do
        if [[ $p == -* ]]; then
            options+=("$p")
        else
            dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
        fi
    done
    ((${#missing[@]})) || return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${options[@]}" "${missing[@]}" >/dev/null
}

#!/usr/bin/env bash
# The guardfs devcontainer Feature's installer: run as root while the image is built, with the
# Feature's options as upper-cased environment variables (VERSION, SOURCE, KEEPBUILDDEPS).
#
# Installs the system packages guard needs at run time (fuse3, bubblewrap, git, python3),
# guardfs into its own virtual environment /opt/guardfs with `guard` on PATH
# (/usr/local/bin/guard), and removes again the build packages it added (unless
# KEEPBUILDDEPS=true). pip reads its usual settings from the build's environment
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_CERT, pip.conf). Debian and Ubuntu images (apt-get).
#
# Nothing here runs at container start: the workspace is not guarded; agents are, one at a
# time, with `guard run -- <agent>`.
set -euo pipefail

VERSION=${VERSION:-latest}
SOURCE=${SOURCE:-}
KEEPBUILDDEPS=${KEEPBUILDDEPS:-false}
PREFIX=/opt/guardfs
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME=(fuse3 libfuse3-3 bubblewrap git python3 python3-venv ca-certificates)
# The compiler and headers for guardfs's C extension and pyfuse3 (built from source by pip).
BUILD=(gcc libc6-dev libfuse3-dev pkg-config python3-dev)

fail() { printf 'guardfs feature: %s\n' "$*" >&2; exit 1; }
say() { printf 'guardfs feature: %s\n' "$*" >&2; }
installed() { dpkg-query -W -f='${db:Status-Abbrev} ${binary:Package}\n' 2>/dev/null | awk '$1 == "ii" {print $2}' | sort; }

[ "$(id -u)" -eq 0 ] || fail "install.sh runs as root (the devcontainer CLI runs it so while it builds the image)"
command -v apt-get >/dev/null || fail "this image has no apt-get: the Feature installs on Debian or Ubuntu images only (for another distribution install fuse3, bubblewrap, git and python3 and 'pip install guardfs' in your Dockerfile)"
case $KEEPBUILDDEPS in true|false) ;; *) fail "keepBuildDeps is '$KEEPBUILDDEPS': give true or false" ;; esac

# What pip installs: a file or URL from `source`, else `version` from the index.
if [ -n "$SOURCE" ]; then
    case $SOURCE in
        http://*|https://*) spec=$SOURCE ;;
        /*) spec=$SOURCE ;;
        *) spec=$HERE/$SOURCE ;;
    esac
    case $spec in
        http://*|https://*) ;;
        *) [ -f "$spec" ] || fail "source '$SOURCE' is not a file ($spec): copy the wheel or sdist into the Feature's folder and give its name, or give an absolute path or an http(s) URL" ;;
    esac
    case $spec in
        *.whl|*.tar.gz|*.zip) ;;
        *) fail "source '$SOURCE' is neither a wheel (.whl) nor an sdist (.tar.gz, .zip)" ;;
    esac
elif [ "$VERSION" = latest ]; then
    spec=guardfs
else
    case $VERSION in
        *[!0-9A-Za-z.+!-]*) fail "version '$VERSION' is not a version (for example 0.1.0, or latest)" ;;
    esac
    spec=guardfs==$VERSION
fi

export DEBIAN_FRONTEND=noninteractive
say "installing ${RUNTIME[*]}"
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${RUNTIME[@]}" >/dev/null
before_build=$(installed)
say "installing the build packages ${BUILD[*]}"
apt-get install -y -qq --no-install-recommends "${BUILD[@]}" >/dev/null
# Exactly what the build packages brought in (not what the image had before): removed after.
added=$(comm -13 <(printf '%s\n' "$before_build") <(installed) | tr '\n' ' ')

say "installing $spec into $PREFIX"
# /usr/bin/python3, the one installed above (another Feature may put its own first on PATH).
/usr/bin/python3 -m venv "$PREFIX"
"$PREFIX/bin/pip" install --no-cache-dir --disable-pip-version-check --quiet "$spec"
ln -sf "$PREFIX/bin/guard" /usr/local/bin/guard

if [ "$KEEPBUILDDEPS" = false ] && [ -n "${added// /}" ]; then
    say "removing the build packages it added: $added"
    # shellcheck disable=SC2086  # one word per package
    apt-get purge -y -qq $added >/dev/null
fi
rm -rf /var/lib/apt/lists/*

# The install works with the build packages gone: guard starts and its extension loads.
guard --version >&2
"$PREFIX/bin/python" -c 'import guardfs._fusereply, pyfuse3' \
    || fail "guardfs is installed but its compiled parts do not load (see the errors above)"
say "done: agents run guarded with 'guard run -- <agent>' (see the Feature's README)"

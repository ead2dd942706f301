#!/usr/bin/env bash
# Render a Helm chart like `helm template`: with the real `helm` when it is on PATH,
# otherwise with deploy/helm/render (Helm's template engine in miniature, built from
# Debian's Go toolchain and Go source packages, offline) into .cache/helm-render.
#
#   bash scripts/helm-render.sh RELEASE deploy/helm/inferd [-f values.yaml]... [--set k=v]...
#   bash scripts/helm-render.sh --build     # install and build only (make test runs this)
#
# INFERD_HELM=/path/to/helm picks a helm binary; INFERD_HELM=builtin forces the renderer.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
src=$root/deploy/helm/render/main.go
bin=$root/.cache/helm-render/helm-render
packages=(golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev
          golang-github-xeipuuv-gojsonschema-dev)

helm=${INFERD_HELM:-$(command -v helm || true)}
if [ -n "$helm" ] && [ "$helm" != builtin ]; then
    [ "${1:-}" = --build ] && exit 0
    exec "$helm" template "$@"
fi

build() {
    local missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if ((${#missing[@]})); then
        if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
            echo "helm-render: needs the Debian packages ${missing[*]} (or helm on PATH)" >&2
            return 1
        fi
        echo "helm-render: installing ${missing[*]} ..." >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
                 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
    fi
    mkdir -p "$(dirname "$bin")"
    # GOPATH mode over Debian's Go sources (/usr/share/gocode): no module proxy needed.
    (cd "$root/deploy/helm/render" &&
        GO111MODULE=off GOPATH=/usr/share/gocode GOCACHE="$root/.cache/helm-render/gocache" \
        GOFLAGS= GOTOOLCHAIN=local go build -o "$bin.tmp" main.go)
    mv "$bin.tmp" "$bin"
}

if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ]; then
    build
fi
if [ "${1:-}" = --build ]; then
    exit 0
fi
exec "$bin" "$@"

#!/usr/bin/env bash
# Pack a Docker engine + docker SDK + the sandbox base image for the lent GPU host (no Docker,
# no network there), into git-ignored folders that the `run` tool can carry (<= 64 MiB a call).
#
# What it does (here, as root, on this Debian machine):
#   .gpu-docker/engine.tar.xz   bin/{dockerd,containerd,containerd-shim-runc-v2,runc,docker-init}
#                               and lib/ (their non-glibc shared libraries: libsystemd,
#                               libdevmapper, libseccomp, ...; host glibc >= 2.34 is needed)
#   .gpu-docker/wheels/         docker==<.venv version> (+ requests, urllib3, charset_normalizer,
#                               idna, certifi at the .venv versions), py3-none-any wheels only
#   .gpu-docker/MANIFEST        versions, image tag/id, sha256 and sizes of every piece
#   .gpu-docker-image/          `docker save` of flashpost/sandbox-base:<recipe hash> (+ :latest),
#                               xz -9; split into .gpu-docker-image2/, ... if over the limit
# It starts the local engine (infra/docker/ensure_engine.sh) and builds the base image with
# infra/docker/build_base_image.sh when missing. Each piece is rebuilt only when its inputs
# changed (binary sha256s, image id, wheel versions), so a second run is quick.
# What it does not do: run anything on the GPU host (that is infra/gpu/start_docker.sh), or
# bundle the docker CLI, docker-proxy (not needed: --userland-proxy=false) or task images.
#
# Usage: bash infra/gpu/docker_bundle.sh            (FOLDER_LIMIT_MIB=60 by default)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=$ROOT/.gpu-docker
IMG_PREFIX=$ROOT/.gpu-docker-image
LIMIT_MIB=${FOLDER_LIMIT_MIB:-60}
PY=${BUNDLE_PYTHON:-$ROOT/.venv/bin/python}
say() { echo "[docker_bundle] $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
mib() { awk -v b="$1" 'BEGIN{printf "%.1f", b/1048576}'; }
size_of() { du -sb "$1" | cut -f1; }

[[ $(id -u) -eq 0 ]] || die "run as root (docker save, reading the engine binaries)"
command -v xz >/dev/null || die "xz is missing (apt-get install xz-utils)"
[[ -x $PY ]] || die "no $PY: run infra/setup_python.sh first (or set BUNDLE_PYTHON)"

bash infra/docker/ensure_engine.sh
TAG=$(bash infra/docker/build_base_image.sh)   # builds only when the tag is missing
REPO_LATEST=${TAG%%:*}:latest
IMAGE_ID=$(docker image inspect --format '{{.Id}}' "$TAG")
say "base image $TAG ($IMAGE_ID)"

mkdir -p "$OUT/wheels"

# ----------------------------------------------------------------------- engine binaries
find_bin() {  # first of PATH lookup or known locations; resolves symlinks
    local name=$1 p
    p=$(command -v "$name" 2>/dev/null || true)
    [[ -n $p ]] || for d in /usr/libexec/docker /usr/local/libexec/docker /usr/local/lib/docker; do
        [[ -x $d/$name ]] && { p=$d/$name; break; }
    done
    [[ -n $p ]] || die "$name not found on this machine (apt-get install docker.io containerd runc tini)"
    readlink -f "$p"
}
BINS=(dockerd containerd containerd-shim-runc-v2 runc docker-init)
declare -A BIN_PATH
for b in "${BINS[@]}"; do BIN_PATH[$b]=$(find_bin "$b"); done
bin_key=$(for b in "${BINS[@]}"; do sha256sum "${BIN_PATH[$b]}"; done | sha256sum | cut -c1-16)

if [[ -f $OUT/engine.tar.xz && $(cat "$OUT/engine.key" 2>/dev/null) == "$bin_key" ]]; then
    say "engine.tar.xz up to date ($(mib "$(size_of "$OUT/engine.tar.xz")") MiB)"
else
    stage=$(mktemp -d /tmp/gpu-docker-stage.XXXXXX)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/bin" "$stage/lib"
    for b in "${BINS[@]}"; do install -m 0755 "${BIN_PATH[$b]}" "$stage/bin/$b"; done
    # Shared libraries, minus the glibc family (those must come from the host's own glibc).
    for b in "${BINS[@]}"; do ldd "${BIN_PATH[$b]}" 2>/dev/null || true; done \
        | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
            case $(basename "$lib") in
                libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libresolv.so.*) continue ;;
            esac
            cp -L "$lib" "$stage/lib/$(basename "$lib")"
        done
    {
        echo "dockerd: $("$stage/bin/dockerd" --version 2>&1 | head -1)"
        echo "containerd: $("$stage/bin/containerd" --version 2>&1 | head -1)"
        echo "runc: $("$stage/bin/runc" --version 2>&1 | head -1)"
        echo "docker-init: $("$stage/bin/docker-init" --version 2>&1 | head -1)"
        echo "glibc needed: $(for f in "$stage"/bin/* "$stage"/lib/*; do objdump -T "$f" 2>/dev/null; done \
            | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
    } >"$stage/VERSIONS"
    say "compressing engine ($(mib "$(size_of "$stage")") MiB raw) with xz -9 -T1"
    tar -C "$stage" -cf - bin lib VERSIONS | xz -9 -T1 -c >"$OUT/engine.tar.xz.tmp"
    mv "$OUT/engine.tar.xz.tmp" "$OUT/engine.tar.xz"
    echo "$bin_key" >"$OUT/engine.key"
    cp "$stage/VERSIONS" "$OUT/ENGINE_VERSIONS"
    rm -rf "$stage"; trap - EXIT
    say "engine.tar.xz: $(mib "$(size_of "$OUT/engine.tar.xz")") MiB"
fi

# ------------------------------------------------------------------------------- wheels
pkg_version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
WHEEL_PKGS=(docker requests urllib3 charset_normalizer idna certifi)
for p in "${WHEEL_PKGS[@]}"; do
    v=$(pkg_version "$p") || die "$p is not installed in $PY"
    norm=$(echo "$p" | tr '-' '_')
    if compgen -G "$OUT/wheels/${norm}-${v}-*py3-none-any.whl" >/dev/null \
        || compgen -G "$OUT/wheels/${norm}-${v}-py2.py3-none-any.whl" >/dev/null; then
        continue
    fi
    rm -f "$OUT/wheels/${norm}"-*.whl
    say "pip download $p==$v (py3-none-any only)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform any --python-version 3.12 \
        --implementation py -d "$OUT/wheels" "$p==$v" \
        || die "no pure-Python wheel of $p==$v could be downloaded"
done
for w in "$OUT"/wheels/*.whl; do
    [[ $w == *-none-any.whl ]] || die "$w is not a pure-Python wheel"
done

# -------------------------------------------------------------------------------- image
if [[ $(cat "$IMG_PREFIX/image.id" 2>/dev/null) == "$IMAGE_ID" ]]; then
    say "image bundle up to date"
else
    rm -rf "$IMG_PREFIX" "$IMG_PREFIX"[0-9]*
    mkdir -p "$IMG_PREFIX"
    tmp=$IMG_PREFIX/image.tar.xz.tmp
    say "docker save $TAG $REPO_LATEST | xz -9 -T1 (a few minutes on one core)"
    docker save "$TAG" "$REPO_LATEST" | xz -9 -T1 -c >"$tmp"
    img_sha=$(sha256sum "$tmp" | cut -d' ' -f1)
    img_size=$(size_of "$tmp")
    limit=$((LIMIT_MIB * 1048576 - 1048576))   # leave 1 MiB for the small files
    if ((img_size <= limit)); then
        mv "$tmp" "$IMG_PREFIX/image.tar.xz"
        parts="image.tar.xz"
    else
        # Split across folders .gpu-docker-image/, .gpu-docker-image2/, ... (carried one per call).
        split -b "$limit" -d -a 2 "$tmp" "$IMG_PREFIX/image.tar.xz.part"
        rm -f "$tmp"
        parts=""
        n=1
        for f in "$IMG_PREFIX"/image.tar.xz.part*; do
            if ((n > 1)); then mkdir -p "$IMG_PREFIX$n"; mv "$f" "$IMG_PREFIX$n/"; fi
            parts+="$(basename "$f") "
            n=$((n + 1))
        done
    fi
    {
        echo "tag=$TAG"
        echo "latest=$REPO_LATEST"
        echo "id=$IMAGE_ID"
        echo "recipe_sha256=$(sha256sum infra/docker/base_image.recipe | cut -d' ' -f1)"
        echo "xz_sha256=$img_sha"
        echo "xz_bytes=$img_size"
        echo "parts=${parts% }"
    } >"$IMG_PREFIX/IMAGE"
    echo "$IMAGE_ID" >"$IMG_PREFIX/image.id"
fi

# ----------------------------------------------------------------------------- manifest
{
    echo "# written by infra/gpu/docker_bundle.sh $(date -u +%FT%TZ); unpack with infra/gpu/start_docker.sh"
    echo "image_tag=$TAG"
    echo "image_id=$IMAGE_ID"
    cat "$OUT/ENGINE_VERSIONS"
    echo "--- files (sha256, bytes)"
    (cd "$ROOT" && find .gpu-docker .gpu-docker-image* -type f ! -name MANIFEST | sort \
        | while read -r f; do echo "$(sha256sum "$f" | cut -c1-16) $(stat -c %s "$f") $f"; done)
} >"$OUT/MANIFEST"

status=0
for d in "$OUT" "$IMG_PREFIX" "$IMG_PREFIX"[0-9]*; do
    [[ -d $d ]] || continue
    s=$(size_of "$d")
    say "$(basename "$d")/: $(mib "$s") MiB"
    if ((s > LIMIT_MIB * 1048576)); then say "ERROR: $(basename "$d") is over ${LIMIT_MIB} MiB"; status=1; fi
done
folders=$(cd "$ROOT" && ls -d .gpu-docker .gpu-docker-image* | tr '\n' ' ')
say "done; carry each of these once (one per run call if together they pass 64 MiB): $folders"
exit $status
